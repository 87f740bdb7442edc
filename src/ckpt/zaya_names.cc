#include "ckpt/zaya_names.h"

#include <algorithm>
#include <optional>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "ckpt/comm.h"
#include "ckpt/metadata.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "ckpt/writer.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/fileio.h"
#include "common/yaml_checks.h"

namespace fs = std::filesystem;

namespace keel::ckpt::zaya {
namespace {

using model::released::layout_hint;
using model::released::row_numel;

bool is_bias_tensor(const std::string& keel) { return keel.rfind("router/", 0) == 0; }

void convert_to_f32(const SafetensorsEntry& e, const char* raw, float* out) {
  const std::int64_t n = numel(e.shape);
  switch (e.type) {
    case ElemType::kF32: std::memcpy(out, raw, static_cast<std::size_t>(n) * 4); break;
    case ElemType::kBF16:
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, raw + 2 * i, 2);
        out[i] = bf16_bits_to_float(h);
      }
      break;
    case ElemType::kF16:
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, raw + 2 * i, 2);
        out[i] = fp16_bits_to_float(h);
      }
      break;
    default: fail("dtype {}: only F32, BF16 and F16 weights can be imported", safetensors_name(e.type));
  }
}

// The released tensors of `in` by name (one file, or the shards of a sharded release).
struct Sources {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsEntry*>> tensors;
};

Sources open_sources(const std::string& in) {
  std::vector<std::string> paths;
  if (fs::is_directory(in)) {
    const fs::path index = fs::path(in) / "model.safetensors.index.json";
    if (fs::exists(index)) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(read_file(index.string()));
      } catch (const std::exception& e) {
        fail("{}: not a valid safetensors index ({})", index.string(), e.what());
      }
      if (!j.contains("weight_map") || !j["weight_map"].is_object())
        fail("{}: no \"weight_map\" object", index.string());
      std::set<std::string> files;
      for (const auto& [name, file] : j["weight_map"].items()) {
        if (!file.is_string()) fail("{}: weight_map entry '{}' is not a file name", index.string(), name);
        files.insert(file.get<std::string>());
      }
      for (const auto& f : files) paths.push_back((fs::path(in) / f).string());
    } else if (fs::exists(fs::path(in) / "model.safetensors")) {
      paths.push_back((fs::path(in) / "model.safetensors").string());
    } else {
      fail("{}: a directory without model.safetensors.index.json or model.safetensors", in);
    }
  } else {
    paths.push_back(in);
  }
  Sources s;
  for (const auto& p : paths) {
    s.files.push_back(std::make_unique<SafetensorsFile>(p));
    const SafetensorsFile* f = s.files.back().get();
    for (const auto& e : f->entries()) {
      auto [it, fresh] = s.tensors.emplace(e.name, std::make_pair(f, &e));
      if (!fresh) fail("{}: tensor '{}' is also in {}", p, e.name, it->second.first->path());
    }
  }
  return s;
}

// A model named after the directory its config.json is in (ZAYA1-8B/config.json: "ZAYA1-8B").
std::string release_name(const std::string& config_path) {
  const std::string name = fs::absolute(config_path).lexically_normal().parent_path().filename().string();
  return name.empty() || !why_not_utf8(name).empty() ? "imported" : name;
}

}  // namespace

std::string release_config_path(const std::string& in) {
  const fs::path dir = fs::is_directory(in) ? fs::path(in) : fs::path(in).parent_path();
  const fs::path p = dir / "config.json";
  return fs::exists(p) ? p.string() : "";
}

model::ModelConfig release_model(const std::string& in, Names names, const std::optional<model::ModelConfig>& given,
                                 const std::string& given_path) {
  const std::string path = release_config_path(in);
  if (path.empty()) {
    if (given) return *given;
    throw UsageError(fmt::format("{}: no config.json beside the weights: name the model with --model CONFIG.yaml", in));
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_config_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(fmt::format("{}: not valid JSON ({})", path, e.what()));
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  const model::ModelConfig cfg = model_of_hf_config(j, names, release_name(path), path);
  if (!given) return cfg;
  const auto a = model::model_key_values(cfg), b = model::model_key_values(*given);
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].second != b[i].second)
      throw UsageError(fmt::format("{}: describes another model than --model {} ('{}'): {} is {} in config.json, {} in "
                                   "--model",
                                   path, given_path, given->name, a[i].first, a[i].second, b[i].second));
  return *given;
}

std::string imported_train_config(const model::ModelConfig& cfg) {
  YAML::Node root;
  root["model"] = model::model_node(cfg);
  root["data"]["datasets"]["none"] = "(weights imported by keel ckpt import: no training data)";
  root["data"]["seq_length"] = std::to_string(cfg.max_seq_len > 0 ? std::min(cfg.max_seq_len, 2048) : 2048);
  root["steps"] = "1";
  YAML::Emitter em;
  em << root;
  return fmt::format("# The model of weights imported by keel ckpt import --names, which keel generate, keel eval and\n"
                     "# keel train (init_from) read from here; data and steps are placeholders.\n{}\n",
                     em.c_str());
}

ElemType parse_export_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32" || s == "float32") return ElemType::kF32;
  if (s == "bf16" || s == "bfloat16") return ElemType::kBF16;
  throw UsageError(fmt::format("unknown --dtype '{}' (fp32, bf16)", s));
}

ZayaStats export_zaya_safetensors(const std::string& src, const std::string& out, const model::ModelConfig& cfg,
                                  Names names, ElemType dtype, int threads, const model::released::TokenIds& ids,
                                  bool overwrite) {
  if (dtype != ElemType::kF32 && dtype != ElemType::kBF16) fail("export dtype must be f32 or bf16");
  const NameMap map = build_name_map(cfg, names);
  check_coverage(map);
  const Reader reader(src);
  const Metadata& m = reader.metadata();
  std::map<std::string, const TensorMeta*> stored;
  for (const auto& t : m.tensors) stored[t.name] = &t;
  std::set<std::string> absent;  // optional keel tensors the checkpoint lacks
  for (const auto& k : map.keel) {
    auto it = stored.find(k.name);
    if (it == stored.end()) {
      if (is_bias_tensor(k.name)) {
        absent.insert(k.name);
        continue;
      }
      fail("{}: no tensor '{}' {}: not a checkpoint of model '{}' (keel train's model/ tensors)", reader.dir(), k.name,
           shape_str(k.shape), cfg.name);
    }
    if (it->second->shape != k.shape)
      fail("{}: tensor '{}' is {} in the checkpoint, model '{}' needs {}", reader.dir(), k.name,
           shape_str(it->second->shape), cfg.name, shape_str(k.shape));
    if (it->second->type != ElemType::kF32)
      fail("{}: tensor '{}' is {}, expected f32 (keel train's master weights)", reader.dir(), k.name,
           elem_name(it->second->type));
  }
  std::vector<const Rule*> rules;
  std::vector<SafetensorsWriter::Tensor> list;
  for (const auto& r : map.rules) {
    if (r.optional && std::any_of(r.pieces.begin(), r.pieces.end(),
                                  [&](const Piece& p) { return absent.count(p.keel) > 0; }))
      continue;
    rules.push_back(&r);
    // The balancing biases stay fp32: the release keeps them fp32 buffers, and rounding them
    // would change which expert a token picks.
    const bool bias = is_bias_tensor(r.pieces.front().keel);
    list.push_back({r.released, bias ? ElemType::kF32 : dtype, r.shape});
  }
  std::string path = out;
  // A Hugging Face model is a directory: anything not named *.safetensors is one.
  if (!out.ends_with(".safetensors")) path = (fs::path(out) / "model.safetensors").string();
  const std::string config = (fs::path(path).parent_path() / "config.json").string();
  check_export_target(reader.dir(), path, overwrite);  // before anything is created
  check_export_target(reader.dir(), config, overwrite);
  if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path());
  const nlohmann::json meta = {{"format", "pt"},
                               {"keel.step", std::to_string(m.step)},
                               {"keel.names", to_string(names)},
                               {"keel.model", cfg.name}};
  SafetensorsWriter w(path, list, meta);
  LoadOptions lo;
  lo.threads = threads;
  std::vector<float> buf;
  std::vector<std::uint16_t> half;
  for (std::size_t i = 0; i < rules.size(); ++i) {
    const Rule& r = *rules[i];
    buf.resize(static_cast<std::size_t>(numel(r.shape)));
    std::vector<LoadRequest> reqs;
    std::int64_t at = 0;
    for (const auto& p : r.pieces) {
      const Shape& ks = map.keel_tensor(p.keel).shape;
      Box box = full_box(ks);
      box.offsets[0] = p.row0;
      box.lengths[0] = p.rows;
      reqs.push_back({p.keel, ElemType::kF32, ks, box, buf.data() + at});
      at += p.rows * row_numel(ks);
    }
    reader.load(reqs, lo);
    if (list[i].type == ElemType::kBF16) {
      half.resize(buf.size());
      for (std::size_t j = 0; j < buf.size(); ++j) half[j] = float_to_bf16_bits(buf[j]);
      w.append(half.data(), half.size() * 2);
    } else {
      w.append(buf.data(), buf.size() * 4);
    }
  }
  w.commit();
  write_file_atomically(config, hf_config(cfg, names, dtype == ElemType::kBF16 ? "bfloat16" : "float32", ids).dump(2) + "\n");
  return {rules.size(), w.data_bytes(), m.step, path, config};
}

ZayaStats import_zaya_safetensors(const std::string& in, const std::string& dst, const model::ModelConfig& cfg,
                                  Names names, std::optional<std::int64_t> step, int threads,
                                  const std::string& model_from) {
  if (step && *step < 0) fail("import: step {} is negative: steps are non-negative", *step);
  const NameMap map = build_name_map(cfg, names);
  check_coverage(map);
  require_new_root(dst);
  const Sources src = open_sources(in);
  for (const auto& [name, where] : src.tensors) {
    const bool dropped =
        std::find(map.dropped_on_import.begin(), map.dropped_on_import.end(), name) != map.dropped_on_import.end();
    if (!map.find(name) && !dropped)
      fail("{}: tensor '{}' is not a {} parameter of model '{}' ({} layers, {} experts){}", where.first->path(), name,
           to_string(names), cfg.name, cfg.layers, cfg.experts, layout_hint(name, names));
    if (dropped && where.second->shape != Shape{cfg.vocab_size, cfg.hidden})
      fail("{}: tensor '{}' is {}, model '{}' needs {}", where.first->path(), name, shape_str(where.second->shape),
           cfg.name, shape_str({cfg.vocab_size, cfg.hidden}));
  }
  std::map<std::string, std::vector<float>> keel;  // the keel tensors written
  std::vector<char> raw;
  std::vector<float> f32;
  for (const auto& r : map.rules) {
    auto it = src.tensors.find(r.released);
    if (it == src.tensors.end()) {
      if (r.optional) continue;
      fail("{}: no tensor '{}' {} (keel's '{}'): not {} weights of model '{}'", in, r.released, shape_str(r.shape),
           r.pieces.front().keel, to_string(names), cfg.name);
    }
    const auto& [file, e] = it->second;
    if (e->shape != r.shape)
      fail("{}: tensor '{}' is {}, model '{}' needs {}", file->path(), r.released, shape_str(e->shape), cfg.name,
           shape_str(r.shape));
    raw.resize(std::max<std::uint64_t>(1, e->nbytes()));
    file->read(*e, raw.data());
    f32.resize(static_cast<std::size_t>(numel(r.shape)));
    try {
      convert_to_f32(*e, raw.data(), f32.data());
    } catch (const Error& err) {
      fail("{}: tensor '{}': {}", file->path(), r.released, err.what());
    }
    std::int64_t at = 0;
    for (const auto& p : r.pieces) {
      const Shape& ks = map.keel_tensor(p.keel).shape;
      auto& dstv = keel[p.keel];
      if (dstv.empty()) dstv.assign(static_cast<std::size_t>(numel(ks)), 0.f);
      const std::int64_t n = p.rows * row_numel(ks);
      std::copy(f32.begin() + at, f32.begin() + at + n, dstv.begin() + p.row0 * row_numel(ks));
      at += n;
    }
  }
  std::vector<SaveShard> shards;
  for (const auto& k : map.keel) {
    auto it = keel.find(k.name);
    if (it == keel.end()) continue;  // optional (balancing biases the release lacks)
    mesh::Placement p;
    p.dims.assign(k.shape.size(), {});
    shards.push_back({k.name, ElemType::kF32, k.shape, p, full_box(k.shape), it->second.data(), true});
  }
  const std::int64_t at = step ? *step : recorded_step(*src.files.front()).value_or(0);
  nlohmann::json state = {{"imported_from", in},
                          {"names", to_string(names)},
                          {"model", cfg.name},
                          {"kind", "keel ckpt import --names"},
                          {"step", at},
                          {"model_from", model_from},
                          {"config", imported_train_config(cfg)}};
  auto comm = make_self_comm();
  fs::create_directories(dst);
  SaveOptions so;
  so.threads = threads;
  Saver saver(*comm, dst, so);
  saver.save(at, shards, state, nlohmann::json::object(), "");
  keel.clear();  // save() staged its own copy
  const SaveStats st = *saver.wait();
  return {shards.size(), st.bytes, at, st.dir, ""};
}


}  // namespace keel::ckpt::zaya

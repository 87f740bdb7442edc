// ZAYA1 weights in and out (src/ckpt/zaya_names.*): a keel train checkpoint survives export ->
// import bit for bit under both layouts, and bad files are one clear error naming the tensor.
// The mapping itself: tests/model/released_names_test.cc.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "ckpt/reader.h"
#include "ckpt/safetensors.h"
#include "ckpt/zaya_names.h"
#include "common/dtype.h"
#include "common/error.h"
#include "generate/generate.h"
#include "model/config.h"
#include "train/model.h"
#include "train/train_checkpoint.h"
#include "train/train_config.h"
#include "../error_message.h"
#include "../model/release_like.h"

namespace fs = std::filesystem;

namespace keel::ckpt::zaya {
namespace {

model::ModelConfig config(const char* name) {
  return model::load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/" + name);
}

struct TmpDir {
  fs::path path;
  TmpDir() {
    path = fs::temp_directory_path() / ("keel_zaya_names_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(std::random_device{}()));
    fs::create_directories(path);
  }
  ~TmpDir() { fs::remove_all(path); }
};

template <typename F>
std::string error_of(F f) {
  return test::error_message(f, "(no error)");
}

// A keel train checkpoint of `cfg` with random values everywhere (params, optimizer moments,
// router biases), as keel train writes it.
train::TrainState save_random_checkpoint(const model::ModelConfig& cfg, const fs::path& root, std::int64_t step) {
  const optim::ParamLayout layout = model::param_layout(cfg);
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.f, 1.f);
  train::TrainState st;
  const auto n = static_cast<std::size_t>(layout.total_floats);
  st.params.resize(n);
  st.shard_end = layout.total_floats;  // one rank: the whole buffer
  st.adam_m.resize(n);
  st.adam_v.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    st.params[i] = normal(rng);
    st.adam_m[i] = normal(rng);
    st.adam_v[i] = std::abs(normal(rng));
  }
  const int classes = cfg.experts + (cfg.router_skip_expert ? 1 : 0);
  for (int l = 0; l < model::moe_layer_count(cfg); ++l) {
    st.router_bias.emplace_back(classes);
    for (auto& b : st.router_bias.back()) b = 0.01f * normal(rng);
  }
  st.adamw_step = step;
  train::TrainCheckpointer ck(root.string(), {});
  ck.save(step, st, layout, nlohmann::json{{"model", cfg.name}});
  ck.finish();
  return st;
}

// Reads every model/ tensor and router bias of a checkpoint back into a TrainState's layout.
train::TrainState read_model(const model::ModelConfig& cfg, const std::string& dir) {
  const optim::ParamLayout layout = model::param_layout(cfg);
  train::TrainState st;
  st.params.assign(static_cast<std::size_t>(layout.total_floats), 0.f);
  const Reader reader(dir);
  std::vector<LoadRequest> reqs;
  for (const auto& p : layout.params) {
    const Shape s(p.shape.begin(), p.shape.end());
    reqs.push_back({"model/" + p.name, ElemType::kF32, s, full_box(s), st.params.data() + p.offset});
  }
  const int classes = cfg.experts + (cfg.router_skip_expert ? 1 : 0);
  st.router_bias.assign(static_cast<std::size_t>(model::moe_layer_count(cfg)), std::vector<float>(classes));
  for (std::size_t i = 0; i < st.router_bias.size(); ++i)
    reqs.push_back({"router/bias." + std::to_string(i), ElemType::kF32, {classes}, full_box({classes}),
                    st.router_bias[i].data()});
  reader.load(reqs);
  return st;
}

// Every parameter element compared bit for bit (padding between parameters excluded).
void expect_same_params(const model::ModelConfig& cfg, const std::vector<float>& want, const std::vector<float>& got,
                        bool bf16) {
  for (const auto& p : model::param_layout(cfg).params) {
    std::int64_t bad = 0;
    for (std::int64_t i = 0; i < p.numel; ++i) {
      float w = want[static_cast<std::size_t>(p.offset + i)];
      if (bf16) w = bf16_round(w);
      bad += std::memcmp(&w, &got[static_cast<std::size_t>(p.offset + i)], 4) != 0;
    }
    EXPECT_EQ(bad, 0) << p.name;
  }
}

// Copies a safetensors file, letting `edit` change the tensor list (name/shape) and add or drop.
void rewrite(const std::string& in, const std::string& out,
             const std::function<bool(SafetensorsWriter::Tensor&)>& keep_and_edit,
             const std::vector<SafetensorsWriter::Tensor>& extra = {}) {
  const SafetensorsFile f(in);
  std::vector<SafetensorsWriter::Tensor> list;
  std::vector<const SafetensorsEntry*> src;
  for (const auto& e : f.entries()) {
    SafetensorsWriter::Tensor t{e.name, e.type, e.shape};
    if (!keep_and_edit(t)) continue;
    list.push_back(t);
    src.push_back(&e);
  }
  for (const auto& t : extra) list.push_back(t);
  SafetensorsWriter w(out, list, {{"format", "pt"}});
  for (const auto* e : src) {
    std::vector<char> buf(std::max<std::uint64_t>(1, e->nbytes()));
    f.read(*e, buf.data());
    w.append(buf.data(), e->nbytes());
  }
  for (const auto& t : extra) {
    std::vector<char> zeros(static_cast<std::size_t>(numel(t.shape)) * elem_size(t.type));
    w.append(zeros.data(), zeros.size());
  }
  w.commit();
}

TEST(ZayaNames, RoundTripThroughReleasedNamesIsBitExact) {
  const auto cfg = config("zaya1-tiny.yaml");
  TmpDir tmp;
  const train::TrainState st = save_random_checkpoint(cfg, tmp.path / "train", 7);
  for (Names names : {Names::kZaya1, Names::kZaya1Alternating}) {
    for (ElemType dtype : {ElemType::kF32, ElemType::kBF16}) {
      SCOPED_TRACE(std::string(to_string(names)) + " " + std::string(elem_name(dtype)));
      const fs::path dir = tmp.path / (std::string(to_string(names)) + "_" + std::string(elem_name(dtype)));
      const ZayaStats ex = export_zaya_safetensors((tmp.path / "train").string(), dir.string() + "/model.safetensors",
                                                   cfg, names, dtype, 2, {});
      EXPECT_EQ(ex.step, 7);
      EXPECT_TRUE(fs::exists(dir / "config.json"));
      const NameMap map = build_name_map(cfg, names);
      EXPECT_EQ(ex.tensors, map.rules.size());  // balancing biases included
      {
        const SafetensorsFile f(ex.path);
        for (const auto& e : f.entries()) {
          const bool bias = e.name.ends_with("balancing_biases");
          EXPECT_EQ(e.type, bias ? ElemType::kF32 : dtype) << e.name;
          ASSERT_NE(map.find(e.name), nullptr) << e.name;
          EXPECT_EQ(e.shape, map.find(e.name)->shape) << e.name;
        }
        EXPECT_EQ(f.metadata().value("format", ""), "pt");
      }
      const ZayaStats im = import_zaya_safetensors(ex.path, (dir / "imported").string(), cfg, names, 7, 2);
      EXPECT_EQ(im.step, 7);
      const train::TrainState got = read_model(cfg, (dir / "imported").string());
      expect_same_params(cfg, st.params, got.params, dtype == ElemType::kBF16);
      ASSERT_EQ(got.router_bias.size(), st.router_bias.size());
      for (std::size_t i = 0; i < st.router_bias.size(); ++i)
        EXPECT_EQ(std::memcmp(got.router_bias[i].data(), st.router_bias[i].data(), st.router_bias[i].size() * 4), 0);
    }
  }
}

TEST(ZayaNames, ImportsShardedReleaseDirectory) {
  const auto cfg = config("zaya1-tiny.yaml");
  TmpDir tmp;
  const train::TrainState st = save_random_checkpoint(cfg, tmp.path / "train", 3);
  const auto ex = export_zaya_safetensors((tmp.path / "train").string(), (tmp.path / "one.safetensors").string(), cfg,
                                          Names::kZaya1Alternating, ElemType::kF32, 2, {});
  // Split into two shards with an index, as Hugging Face's save_pretrained writes large models.
  const fs::path rel = tmp.path / "release";
  fs::create_directories(rel);
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  for (int shard = 0; shard < 2; ++shard) {
    const std::string name = "model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors";
    rewrite(ex.path, (rel / name).string(), [&](SafetensorsWriter::Tensor& t) {
      const bool first = t.name.find("zaya_block") == std::string::npos;
      if (first != (shard == 0)) return false;
      index["weight_map"][t.name] = name;
      return true;
    });
  }
  std::ofstream(rel / "model.safetensors.index.json") << index.dump(2);
  import_zaya_safetensors(rel.string(), (tmp.path / "imported").string(), cfg, Names::kZaya1Alternating, 0, 2);
  expect_same_params(cfg, st.params, read_model(cfg, (tmp.path / "imported").string()).params, false);
}

// A zaya1-tiny as the release differs from keel's pretraining config (tests/model/release_like.h).
model::ModelConfig release_like_tiny() { return test::release_like_tiny("release", 16, 1024); }

// Hugging Face's layout of a large release: the tensors over two shard files named by
// model.safetensors.index.json, config.json beside them.
fs::path make_sharded_release(const std::string& one_file, const fs::path& rel) {
  fs::create_directories(rel);
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  for (int shard = 0; shard < 2; ++shard) {
    const std::string name = "model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors";
    rewrite(one_file, (rel / name).string(), [&](SafetensorsWriter::Tensor& t) {
      const bool first = t.name.find("mlp") == std::string::npos;
      if (first != (shard == 0)) return false;
      index["weight_map"][t.name] = name;
      return true;
    });
  }
  std::ofstream(rel / "model.safetensors.index.json") << index.dump(2);
  fs::copy_file(fs::path(one_file).parent_path() / "config.json", rel / "config.json");
  return rel;
}

// Issue 36: a release directory imports with no --model: its config.json is the model, which
// the checkpoint records, so generation needs no --model either.
TEST(ZayaNames, ReleaseDirectoryImportsByItsConfigJson) {
  const model::ModelConfig cfg = release_like_tiny();
  TmpDir tmp;
  const train::TrainState st = save_random_checkpoint(cfg, tmp.path / "train", 5);
  const auto ex = export_zaya_safetensors((tmp.path / "train").string(), (tmp.path / "hf").string(), cfg,
                                          Names::kZaya1, ElemType::kF32, 2, {});
  const fs::path rel = make_sharded_release(ex.path, tmp.path / "release");
  EXPECT_EQ(release_config_path(rel.string()), (rel / "config.json").string());
  const model::ModelConfig got = release_model(rel.string(), Names::kZaya1, std::nullopt, "");
  EXPECT_EQ(got, cfg) << model::model_yaml(got);  // named after the directory: "release"

  const std::string dst = (tmp.path / "imported").string();
  const ZayaStats im = import_zaya_safetensors(rel.string(), dst, got, Names::kZaya1, std::nullopt, 2,
                                               (rel / "config.json").string());
  EXPECT_EQ(im.step, 0);  // the shards carry no keel.step
  expect_same_params(cfg, st.params, read_model(cfg, dst).params, false);
  const Reader reader(dst);
  const nlohmann::json& state = reader.metadata().state;
  EXPECT_EQ(state["model_from"], (rel / "config.json").string());
  const train::TrainConfig tc = train::parse_train_config(state["config"].get<std::string>(), "saved config");
  EXPECT_EQ(tc.model, cfg);
  // keel generate's loader takes the model from the checkpoint, and decodes with it.
  generate::ModelWeights w = generate::load_checkpoint_weights(dst, std::nullopt);
  EXPECT_EQ(w.config, cfg);
  expect_same_params(cfg, st.params, w.params, false);
}

TEST(ZayaNames, TheModelComesFromConfigJsonOrModelAndBothMustAgree) {
  const model::ModelConfig cfg = config("zaya1-tiny.yaml");
  TmpDir tmp;
  save_random_checkpoint(cfg, tmp.path / "train", 1);
  const auto ex = export_zaya_safetensors((tmp.path / "train").string(), (tmp.path / "hf").string(), cfg,
                                          Names::kZaya1, ElemType::kF32, 2, {});
  const std::string dir = (tmp.path / "hf").string();
  // config.json beside a single file is read as in its directory.
  EXPECT_EQ(release_config_path(ex.path), dir + "/config.json");
  model::ModelConfig from_json = release_model(ex.path, Names::kZaya1, std::nullopt, "");
  EXPECT_EQ(from_json.name, "hf");
  from_json.name = cfg.name;
  EXPECT_EQ(from_json, cfg);
  // --model agreeing: its name; disagreeing on a key that shapes the computation: refused.
  EXPECT_EQ(release_model(dir, Names::kZaya1, cfg, "tiny.yaml").name, "zaya1-tiny");
  model::ModelConfig other = cfg;
  other.rope_base = 5e6;
  EXPECT_EQ(error_of([&] { release_model(dir, Names::kZaya1, other, "other.yaml"); }),
            dir + "/config.json: describes another model than --model other.yaml ('zaya1-tiny'): rope_base is 10000 in "
                  "config.json, 5000000 in --model");
  // No config.json: --model is the model, and without it one line says to give it.
  fs::remove(dir + "/config.json");
  EXPECT_EQ(release_config_path(dir), "");
  EXPECT_EQ(release_model(dir, Names::kZaya1, other, "other.yaml"), other);
  EXPECT_EQ(error_of([&] { release_model(dir, Names::kZaya1, std::nullopt, ""); }),
            dir + ": no config.json beside the weights: name the model with --model CONFIG.yaml");
  // A config.json keel cannot represent is one line naming the key; so is one that is no JSON.
  nlohmann::json j = hf_config(cfg, Names::kZaya1, "float32", {});
  j["rope_parameters"]["hybrid"]["rope_type"] = "yarn";
  std::ofstream(dir + "/config.json") << j.dump();
  EXPECT_EQ(error_of([&] { release_model(dir, Names::kZaya1, cfg, "tiny.yaml"); }),
            dir + "/config.json: 'rope_parameters.hybrid.rope_type' is \"yarn\": keel runs the default RoPE only");
  std::ofstream(dir + "/config.json") << "{\"vocab_size\": ";
  EXPECT_EQ(error_of([&] { release_model(dir, Names::kZaya1, std::nullopt, ""); }).rfind(dir + "/config.json: not valid JSON", 0),
            0u);
}

TEST(ZayaNames, BadReleasesAreOneClearErrorNamingTheTensor) {
  const auto cfg = config("zaya1-tiny.yaml");
  TmpDir tmp;
  save_random_checkpoint(cfg, tmp.path / "train", 1);
  const std::string train_dir = (tmp.path / "train").string();
  const std::string good = (tmp.path / "good.safetensors").string();
  export_zaya_safetensors(train_dir, good, cfg, Names::kZaya1, ElemType::kBF16, 2, {});
  // An existing output (the file, or config.json beside it) is replaced only with overwrite
  // (--force); an import never writes into a root that holds checkpoints.
  EXPECT_NE(error_of([&] { export_zaya_safetensors(train_dir, good, cfg, Names::kZaya1, ElemType::kBF16, 1, {}); })
                .find(good + ": exists; pass --force to replace it"),
            std::string::npos);
  const std::string beside = (tmp.path / "beside.safetensors").string();
  EXPECT_NE(error_of([&] { export_zaya_safetensors(train_dir, beside, cfg, Names::kZaya1, ElemType::kBF16, 1, {}); })
                .find("config.json: exists; pass --force to replace it"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(beside));
  export_zaya_safetensors(train_dir, good, cfg, Names::kZaya1, ElemType::kBF16, 1, {}, /*overwrite=*/true);
  EXPECT_NE(error_of([&] { import_zaya_safetensors(good, train_dir, cfg, Names::kZaya1, std::nullopt, 1); })
                .find(train_dir + ": already holds checkpoints"),
            std::string::npos);
  const std::string bad = (tmp.path / "bad.safetensors").string();
  auto import_bad = [&](Names names = Names::kZaya1) {
    return error_of([&] { import_zaya_safetensors(bad, (tmp.path / "x").string(), cfg, names, 0, 1); });
  };

  // A wrong shape (transposed k_proj).
  rewrite(good, bad, [](SafetensorsWriter::Tensor& t) {
    if (t.name == "model.layers.1.self_attn.qkv_proj.k_proj.weight") std::swap(t.shape[0], t.shape[1]);
    return true;
  });
  EXPECT_NE(import_bad().find("tensor 'model.layers.1.self_attn.qkv_proj.k_proj.weight' is [256, 128], model "
                              "'zaya1-tiny' needs [128, 256]"),
            std::string::npos)
      << import_bad();

  // An unknown name, and a layer the config does not have.
  rewrite(good, bad, [](SafetensorsWriter::Tensor&) { return true; },
          {{"model.layers.0.mlp.gate.extra_scale", ElemType::kF32, {4}}});
  EXPECT_NE(import_bad().find("tensor 'model.layers.0.mlp.gate.extra_scale' is not a zaya1 parameter of model "
                              "'zaya1-tiny' (2 layers, 4 experts)"),
            std::string::npos)
      << import_bad();
  rewrite(good, bad, [](SafetensorsWriter::Tensor&) { return true; },
          {{"model.layers.2.input_layernorm.weight", ElemType::kF32, {256}}});
  EXPECT_NE(import_bad().find("'model.layers.2.input_layernorm.weight' is not a zaya1 parameter"), std::string::npos);

  // A missing tensor.
  rewrite(good, bad, [](SafetensorsWriter::Tensor& t) { return t.name != "model.layers.0.self_attn.o_proj.weight"; });
  EXPECT_NE(import_bad().find("no tensor 'model.layers.0.self_attn.o_proj.weight' [256, 256] (keel's "
                              "'model/layers.0.attn.cca.wo')"),
            std::string::npos)
      << import_bad();

  // Integer weights.
  rewrite(good, bad, [](SafetensorsWriter::Tensor& t) {
    if (t.name == "model.layers.0.mlp.gate.balancing_biases") t.type = ElemType::kI32;
    return true;
  });
  EXPECT_NE(import_bad().find("tensor 'model.layers.0.mlp.gate.balancing_biases': dtype I32: only F32, BF16 and F16"),
            std::string::npos)
      << import_bad();

  // The other layout's file: the error says which --names fits.
  const std::string other =
      error_of([&] { import_zaya_safetensors(good, (tmp.path / "y").string(), cfg, Names::kZaya1Alternating, 0, 1); });
  EXPECT_NE(other.find("is not a zaya1-alternating parameter"), std::string::npos) << other;
  EXPECT_NE(other.find("use --names zaya1)"), std::string::npos) << other;

  // Export against the wrong model config names the first tensor that does not fit.
  const std::string wrong_model = error_of([&] {
    export_zaya_safetensors(train_dir, (tmp.path / "w.safetensors").string(), config("zaya1-8b.yaml"), Names::kZaya1,
                            ElemType::kF32, 1, {});
  });
  EXPECT_NE(wrong_model.find("tensor 'model/embed.weight' is [1024, 256] in the checkpoint, model 'zaya1-8b' needs "
                             "[262272, 2048]"),
            std::string::npos)
      << wrong_model;
  EXPECT_FALSE(fs::exists(tmp.path / "w.safetensors"));

  // An unknown --dtype (a model that is not ZAYA1's and unknown --names: tests/model/released_names_test.cc).
  EXPECT_THROW(parse_export_dtype("fp8"), UsageError);
}

}  // namespace
}  // namespace keel::ckpt::zaya

#include "train/trainer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "common/error.h"
#include "common/fileio.h"
#include "optim/clip.h"
#include "optim/schedule.h"

namespace keel::train {
namespace {

constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'T', 'R', 'N', '1'};

std::uint64_t fnv1a(const char* p, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 1099511628211ull;
  return h;
}

std::string num(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{:.6g}", x);
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

Trainer::Trainer(TrainConfig config, const ParallelContext& ctx, bool quiet)
    : cfg_(std::move(config)), ctx_(ctx), quiet_(quiet) {
  ctx_.require_single("keel train");
  bool cuda = cfg_.device == "cuda";
  if (cfg_.device == "auto") cuda = cuda_training_available();
  const OptimizerConfig optimizer(cfg_.adamw, cfg_.muon);
  backend_ = cuda ? make_cuda_backend(cfg_.model, cfg_.model_options, optimizer, ctx_)
                  : make_cpu_backend(cfg_.model, cfg_.model_options, optimizer, ctx_);
  // CPUs: about 2 cores of fp32 FMA, the CI machine's; set mfu_peak_flops for a real figure.
  if (!(cfg_.peak_flops > 0)) cfg_.peak_flops = cuda ? device_peak_bf16_flops(backend_->device()) : 1e11;
  data_ = std::make_unique<data::DataPipeline>(cfg_.data);
  for (std::size_t i = 0; i < cfg_.data.prefixes.size(); ++i) {
    // every token id must fit the model's vocabulary: checked per batch below; here a quick size check
    if (data_->dataset(i).tokens() < cfg_.data.seq_length + 1)
      throw UsageError(fmt::format("dataset {} holds {} tokens, fewer than seq_length + 1 = {}", cfg_.data.prefixes[i],
                                   data_->dataset(i).tokens(), cfg_.data.seq_length + 1));
  }
  loader_ = std::make_unique<data::BatchLoader>(data_->stream(), static_cast<std::uint64_t>(cfg_.micro_batch));
  if (!cfg_.eval_prefix.empty()) {
    eval_ds_ = std::make_unique<data::IndexedDataset>(cfg_.eval_prefix);
    eval_sampler_ = std::make_unique<data::SequenceSampler>(*eval_ds_, cfg_.data.seq_length, cfg_.data.seed + 1);
  }
  log_ = std::make_unique<MetricsLog>(cfg_.output_dir, cfg_.tensorboard);
  const std::int64_t N = std::int64_t(cfg_.micro_batch) * cfg_.model_options.seq_length;
  inputs_.resize(N);
  targets_.resize(N);
}

Trainer::~Trainer() = default;

std::string Trainer::checkpoint_path(std::int64_t step) const {
  return (std::filesystem::path(cfg_.checkpoint_dir) / fmt::format("checkpoint-{:08d}.keel", step)).string();
}

StepStats Trainer::train_step() {
  TrainBackend& m = *backend_;
  const std::int64_t L = static_cast<std::int64_t>(cfg_.data.seq_length);
  const std::int64_t V = cfg_.model.vocab_size;
  StepStats s;
  s.step = step_ + 1;
  m.zero_grads();
  const float scale = 1.0f / static_cast<float>(cfg_.grad_accum);
  for (int a = 0; a < cfg_.grad_accum; ++a) {
    const auto rows = loader_->next_batch();
    for (int b = 0; b < cfg_.micro_batch; ++b) {
      const std::uint32_t* row = rows.data() + b * (L + 1);
      for (std::int64_t t = 0; t < L; ++t) {
        if (row[t + 1] >= V)
          throw Error(fmt::format("step {}: token id {} is outside the model's vocabulary ({})", s.step, row[t + 1], V));
        inputs_[b * L + t] = row[t];
        targets_[b * L + t] = static_cast<std::int32_t>(row[t + 1]);
      }
    }
    const LossParts lp = m.forward(inputs_.data(), targets_.data());
    if (!std::isfinite(lp.total))
      throw Error(fmt::format("step {}: loss is {} (ce {}, aux {}, z {}): stopping", s.step, num(lp.total), num(lp.ce),
                              num(lp.aux), num(lp.z)));
    m.backward(scale);
    s.loss += lp.total * scale;
    s.ce += lp.ce * scale;
    s.aux += lp.aux * scale;
    s.z += lp.z * scale;
  }
  s.lr = optim::lr_at(cfg_.schedule, step_);
  StepResult r;
  try {
    r = m.clip_and_step(cfg_.clip, s.lr);
  } catch (const optim::NonFiniteGradient& e) {
    throw Error(fmt::format("step {}: gradient norm is {}{}: stopping", s.step, num(e.norm()),
                            e.param().empty() ? "" : fmt::format(" (first non-finite gradient in '{}')", e.param())));
  }
  s.grad_norm = r.grad_norm;
  // expert load of this step (before the bias update resets the counters)
  s.load_min = 0, s.load_max = 0;
  bool first = true;
  for (int i = 0; i < m.moe_layer_count(); ++i) {
    const auto load = m.load(i);
    double mean = 0;
    for (auto c : load) mean += static_cast<double>(c);
    mean /= static_cast<double>(load.size());
    for (auto c : load) {
      const double f = mean > 0 ? c / mean : 0;
      s.load_min = first ? f : std::min(s.load_min, f);
      s.load_max = first ? f : std::max(s.load_max, f);
      first = false;
    }
  }
  m.update_router_bias();
  ++step_;
  return s;
}

void Trainer::log_step(const StepStats& s, double seconds, std::int64_t tokens) {
  const double tps = seconds > 0 ? tokens / seconds : 0;
  const double flops = backend_->flops_per_micro_batch() * cfg_.grad_accum;
  const double steps_done = static_cast<double>(tokens) /
                            (double(cfg_.micro_batch) * cfg_.model_options.seq_length * cfg_.grad_accum);
  const double mfu = seconds > 0 ? flops * steps_done / seconds / cfg_.peak_flops : 0;
  const double mem = mib(backend_->memory_bytes());
  if (!quiet_)
    std::printf("step %6lld/%lld | loss %.4f (ce %.4f aux %.3f z %.3f) | lr %.3e | grad norm %.3f | %.0f tok/s | "
                "MFU %.2f%% | mem %.1f MiB | expert load %.2f-%.2f\n",
                static_cast<long long>(s.step), static_cast<long long>(cfg_.steps), s.loss, s.ce, s.aux, s.z, s.lr,
                s.grad_norm, tps, 100 * mfu, mem, s.load_min, s.load_max);
  std::fflush(stdout);
  log_->scalars(s.step, {{"loss", s.loss},
                         {"ce", s.ce},
                         {"aux", s.aux},
                         {"z", s.z},
                         {"lr", s.lr},
                         {"grad_norm", s.grad_norm},
                         {"tokens_per_s", tps},
                         {"mfu", mfu},
                         {"memory_mib", mem},
                         {"expert_load_min", s.load_min},
                         {"expert_load_max", s.load_max}});
}

std::vector<StepStats> Trainer::run(std::int64_t until) {
  if (until < 0) until = cfg_.steps;
  until = std::min(until, cfg_.steps);
  std::vector<StepStats> out;
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  std::int64_t tokens = 0;
  const std::int64_t step_tokens = std::int64_t(cfg_.micro_batch) * cfg_.model_options.seq_length * cfg_.grad_accum;
  if (!quiet_ && step_ == 0)
    std::printf("keel train: model '%s' (%lld parameters, %d layers, %d MoE) on %s, %lld steps of %lld tokens, "
                "recompute %s\n",
                cfg_.model.name.c_str(), static_cast<long long>(backend_->param_count()), cfg_.model.layers,
                backend_->moe_layer_count(), backend_->device().c_str(), static_cast<long long>(cfg_.steps),
                static_cast<long long>(step_tokens), to_string(cfg_.model_options.recompute));
  while (step_ < until) {
    const StepStats s = train_step();
    tokens += step_tokens;
    out.push_back(s);
    if (s.step % cfg_.log_interval == 0 || s.step == 1 || s.step == cfg_.steps) {
      const double sec = std::chrono::duration<double>(clock::now() - t0).count();
      log_step(s, sec, tokens);
      t0 = clock::now();
      tokens = 0;
    }
    const bool last = step_ == cfg_.steps;
    if (eval_sampler_ && ((cfg_.eval_interval > 0 && step_ % cfg_.eval_interval == 0) || last)) {
      const double e = evaluate();
      if (!quiet_) std::printf("eval   %6lld | loss %.4f\n", static_cast<long long>(step_), e);
      log_->scalars(step_, {{"eval_loss", e}});
    }
    if ((cfg_.checkpoint_interval > 0 && step_ % cfg_.checkpoint_interval == 0) || (last && cfg_.checkpoint_final)) {
      const std::string p = checkpoint_path(step_);
      save_checkpoint(p);
      if (!quiet_) std::printf("saved %s\n", p.c_str());
    }
    std::fflush(stdout);
  }
  log_->flush();
  return out;
}

double Trainer::evaluate() {
  if (!eval_sampler_) fail("evaluate: no eval.prefix configured");
  const std::int64_t L = static_cast<std::int64_t>(cfg_.data.seq_length);
  std::vector<std::uint32_t> row(L + 1);
  double sum = 0;
  for (std::int64_t b = 0; b < cfg_.eval_batches; ++b) {
    for (int r = 0; r < cfg_.micro_batch; ++r) {
      eval_sampler_->sample(static_cast<std::uint64_t>(b * cfg_.micro_batch + r), row.data());
      for (std::int64_t t = 0; t < L; ++t) {
        if (row[t + 1] >= static_cast<std::uint64_t>(cfg_.model.vocab_size))
          throw Error(fmt::format("eval: token id {} is outside the model's vocabulary", row[t + 1]));
        inputs_[r * L + t] = row[t];
        targets_[r * L + t] = static_cast<std::int32_t>(row[t + 1]);
      }
    }
    sum += backend_->forward(inputs_.data(), targets_.data()).ce;
  }
  backend_->reset_load();
  return sum / static_cast<double>(cfg_.eval_batches);
}

// File: magic "KEELTRN1", u64 header length, JSON header, then the blobs the header lists,
// back to back: parameters, AdamW m, AdamW v (layout.total_floats fp32 each), router biases.
void Trainer::save_checkpoint(const std::string& path) const {
  const TrainState st = backend_->state();
  const std::size_t pbytes = st.params.size() * sizeof(float);
  std::vector<float> biases;
  for (const auto& b : st.router_bias) biases.insert(biases.end(), b.begin(), b.end());
  std::string blobs;
  blobs.append(reinterpret_cast<const char*>(st.params.data()), pbytes);
  blobs.append(reinterpret_cast<const char*>(st.adam_m.data()), pbytes);
  blobs.append(reinterpret_cast<const char*>(st.adam_v.data()), pbytes);
  blobs.append(reinterpret_cast<const char*>(biases.data()), biases.size() * sizeof(float));
  nlohmann::json h;
  h["format"] = "keel.train.checkpoint/1";
  h["step"] = step_;
  h["adamw_step"] = st.adamw_step;
  h["model"] = cfg_.model.name;
  h["total_floats"] = backend_->layout().total_floats;
  h["blobs"] = nlohmann::json::array({{{"name", "params"}, {"bytes", pbytes}},
                                      {{"name", "adamw.m"}, {"bytes", pbytes}},
                                      {{"name", "adamw.v"}, {"bytes", pbytes}},
                                      {{"name", "router_bias"}, {"bytes", biases.size() * sizeof(float)}}});
  nlohmann::json params = nlohmann::json::array();
  for (const auto& p : backend_->layout().params) params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
  h["params"] = params;
  h["sampler"] = loader_->state();
  h["rng"] = {{"init_seed", cfg_.seed}};  // the loop draws no random numbers beyond the sampler's
  h["checksum"] = fnv1a(blobs.data(), blobs.size());
  const std::string header = h.dump();
  std::string file(kMagic, 8);
  const std::uint64_t hl = header.size();
  file.append(reinterpret_cast<const char*>(&hl), 8);
  file += header;
  file += blobs;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path().empty()
                                          ? std::filesystem::path(".")
                                          : std::filesystem::path(path).parent_path());
  write_file_atomically(path, file);
}

void Trainer::resume(const std::string& path_in) {
  std::string path = path_in;
  if (std::filesystem::is_directory(path)) {
    std::string best;
    for (const auto& e : std::filesystem::directory_iterator(path)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("checkpoint-", 0) == 0 && n.ends_with(".keel") && n > best) best = n;
    }
    if (best.empty()) throw UsageError(fmt::format("--resume {}: no checkpoint-*.keel in that directory", path));
    path = (std::filesystem::path(path) / best).string();
  }
  const std::string file = read_file(path);
  auto bad = [&](const std::string& why) { throw Error(fmt::format("checkpoint {}: {}", path, why)); };
  if (file.size() < 16 || std::memcmp(file.data(), kMagic, 8) != 0) bad("not a keel train checkpoint (bad magic)");
  std::uint64_t hl = 0;
  std::memcpy(&hl, file.data() + 8, 8);
  if (16 + hl > file.size()) bad("truncated header");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(file.substr(16, hl));
  } catch (const std::exception& e) {
    bad(std::string("header is not JSON: ") + e.what());
  }
  const optim::ParamLayout& layout = backend_->layout();
  if (h.value("format", "") != "keel.train.checkpoint/1") bad("unknown format");
  if (h.at("total_floats").get<std::int64_t>() != layout.total_floats)
    bad(fmt::format("holds {} parameter floats, this model has {} (another model config?)",
                    h.at("total_floats").get<std::int64_t>(), layout.total_floats));
  const auto& ps = h.at("params");
  if (ps.size() != layout.params.size()) bad("parameter list differs from this model's");
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const auto& p = layout.params[i];
    if (ps[i].at("name").get<std::string>() != p.name || ps[i].at("shape").get<std::vector<std::int64_t>>() != p.shape ||
        ps[i].at("offset").get<std::int64_t>() != p.offset)
      bad(fmt::format("parameter {} ('{}') differs from this model's '{}'", i, ps[i].at("name").get<std::string>(), p.name));
  }
  std::size_t total = 0;
  for (const auto& b : h.at("blobs")) total += b.at("bytes").get<std::size_t>();
  if (file.size() != 16 + hl + total)
    bad(fmt::format("truncated or padded: {} bytes, expected {}", file.size(), 16 + hl + total));
  const char* p = file.data() + 16 + hl;
  if (fnv1a(p, total) != h.at("checksum").get<std::uint64_t>()) bad("checksum mismatch (corrupted)");
  const std::size_t nfloats = static_cast<std::size_t>(layout.total_floats), pbytes = nfloats * sizeof(float);
  TrainState st = backend_->state();  // for the router bias shapes
  st.params.assign(reinterpret_cast<const float*>(p), reinterpret_cast<const float*>(p) + nfloats);
  st.adam_m.assign(reinterpret_cast<const float*>(p + pbytes), reinterpret_cast<const float*>(p + pbytes) + nfloats);
  st.adam_v.assign(reinterpret_cast<const float*>(p + 2 * pbytes),
                   reinterpret_cast<const float*>(p + 2 * pbytes) + nfloats);
  std::size_t off = 3 * pbytes;
  const std::size_t bias_bytes = h.at("blobs")[3].at("bytes").get<std::size_t>();
  std::size_t expect = 0;
  for (const auto& b : st.router_bias) expect += b.size() * sizeof(float);
  if (bias_bytes != expect) bad("router bias size differs");
  for (auto& b : st.router_bias) {
    std::memcpy(b.data(), p + off, b.size() * sizeof(float));
    off += b.size() * sizeof(float);
  }
  st.adamw_step = h.at("adamw_step").get<std::int64_t>();
  backend_->set_state(st);
  try {
    loader_->restore(h.at("sampler"));
  } catch (const Error& e) {
    bad(std::string("sampler state: ") + e.what());
  }
  step_ = h.at("step").get<std::int64_t>();
  if (!quiet_) std::printf("resumed from %s at step %lld\n", path.c_str(), static_cast<long long>(step_));
}

}  // namespace keel::train

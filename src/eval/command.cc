// keel eval: scores a checkpoint on a dataset without training (docs/eval.md). It builds the
// backend keel train would (train::make_cpu_backend / make_cuda_backend, from the checkpoint's
// saved train config), loads the checkpoint's weights and runs forward() over micro-batches of
// seq_length + 1 token windows, exactly as keel train's eval does, so its CE is keel train's
// eval loss on the same windows.
#include "eval/command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/reader.h"
#include "common/error.h"
#include "common/parallel_for.h"
#include "data/indexed_dataset.h"
#include "data/sampler.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "ops/kernel_settings.h"
#include "train/backend.h"
#include "train/train_checkpoint.h"
#include "train/train_config.h"

namespace keel::eval {
namespace {

struct Args {
  std::string checkpoint, data, config, model, logprobs, device = "auto";
  int seq_length = 0, micro_batch = 0, top_k = 0;
  std::int64_t max_batches = 0;
};

// The train config that describes the checkpoint's model and how keel train ran it: the one
// saved beside the tensors, else --config TRAIN.yaml, else --model MODEL.yaml with defaults.
train::TrainConfig checkpoint_config(const Args& a, const std::string& dir, const nlohmann::json& state) {
  if (!a.config.empty() && !a.model.empty()) throw UsageError("eval: give --config or --model, not both");
  if (!a.config.empty()) return train::load_train_config(a.config);
  if (state.contains("config") && state["config"].is_string()) {
    train::TrainConfig tc =
        train::parse_train_config(state["config"].get<std::string>(), fmt::format("checkpoint {} (saved config)", dir));
    if (!a.model.empty()) {
      tc.model = model::load_model_config(a.model);  // load_model_weights checks the tensors' shapes
      tc.model_source = a.model;
    }
    return tc;
  }
  if (a.model.empty())
    throw UsageError(fmt::format("eval: checkpoint {}: no saved train config (imported weights?): name the model with "
                                 "--model MODEL.yaml or --config TRAIN.yaml",
                                 dir));
  train::TrainConfig tc;
  tc.path = a.model;
  tc.model = model::load_model_config(a.model);
  tc.model_source = a.model;
  tc.data.seq_length = static_cast<std::uint64_t>(tc.model.max_seq_len > 0 ? std::min<std::int64_t>(tc.model.max_seq_len, 2048) : 2048);
  tc.micro_batch = 1;
  tc.eval_prefix.clear();
  return tc;
}

std::string human(double tokens) {
  return tokens >= 1e9 ? fmt::format("{:.2f}G", tokens / 1e9)
         : tokens >= 1e6 ? fmt::format("{:.2f}M", tokens / 1e6)
         : tokens >= 1e4 ? fmt::format("{:.1f}k", tokens / 1e3)
                         : fmt::format("{:.0f}", tokens);
}

void run(const Args& a) {
  if (a.device != "auto" && a.device != "cpu" && a.device != "cuda")
    throw UsageError(fmt::format("eval: --device must be auto, cpu or cuda, got '{}'", a.device));
  if (a.max_batches < 0) throw UsageError(fmt::format("eval: --max-batches must be >= 0, got {}", a.max_batches));
  if (a.seq_length < 0 || a.micro_batch < 0)
    throw UsageError("eval: --seq-length and --micro-batch must be >= 1 (0: the config's)");
  if (a.top_k < 0) throw UsageError(fmt::format("eval: --top-k must be >= 0, got {}", a.top_k));
  if (a.top_k > 0 && a.logprobs.empty()) throw UsageError("eval: --top-k writes into the --logprobs file: give --logprobs OUT too");
  std::error_code ec;
  if (!std::filesystem::exists(a.checkpoint, ec))
    throw UsageError(fmt::format("eval: checkpoint {}: No such file or directory", a.checkpoint));
  if (!train::is_ckpt_directory(a.checkpoint))
    throw UsageError(fmt::format("eval: {} is not a keel checkpoint (expected a checkpoint.dir root with `latest`, or a "
                                 "step directory with metadata.json)",
                                 a.checkpoint));
  const ckpt::Reader reader(a.checkpoint);
  train::TrainConfig cfg = checkpoint_config(a, reader.dir(), reader.metadata().state);
  if (a.seq_length > 0) cfg.data.seq_length = static_cast<std::uint64_t>(a.seq_length);
  if (a.micro_batch > 0) cfg.micro_batch = a.micro_batch;
  const std::int64_t L = static_cast<std::int64_t>(cfg.data.seq_length), B = cfg.micro_batch;
  cfg.model_options.seq_length = static_cast<int>(L);
  cfg.model_options.micro_batch = static_cast<int>(B);
  train::validate_trainable(cfg.model, cfg.model_options);

  // The windows: --data in order (no shuffle), every one; else keel train's eval samples.
  const bool train_eval = a.data.empty();
  const std::string prefix = train_eval ? cfg.eval_prefix : a.data;
  if (prefix.empty())
    throw UsageError(fmt::format("eval: give --data PREFIX (the train config of checkpoint {} has no eval.prefix)", reader.dir()));
  std::unique_ptr<data::IndexedDataset> ds;
  try {
    ds = std::make_unique<data::IndexedDataset>(prefix);
  } catch (const Error& e) {
    throw UsageError(fmt::format("eval: {}", e.what()));
  }
  if (ds->tokens() < static_cast<std::uint64_t>(L) + 1)
    throw UsageError(fmt::format("eval: dataset {} holds {} tokens, fewer than one window of seq_length + 1 = {}", prefix,
                                 ds->tokens(), L + 1));
  const data::SequenceSampler sampler(*ds, static_cast<std::uint64_t>(L), train_eval ? cfg.data.seed + 1 : 0,
                                      /*shuffle=*/train_eval);
  std::int64_t windows = train_eval ? cfg.eval_batches * B : static_cast<std::int64_t>(sampler.samples_per_epoch());
  if (a.max_batches > 0) windows = std::min(windows, a.max_batches * B);
  const std::int64_t batches = (windows + B - 1) / B;

  // Every token id inside the model's vocabulary, before any output.
  std::vector<std::uint32_t> row(static_cast<std::size_t>(L + 1));
  for (std::int64_t w = 0; w < windows; ++w) {
    sampler.sample(static_cast<std::uint64_t>(w), row.data());
    for (const std::uint32_t t : row)
      if (t >= static_cast<std::uint64_t>(cfg.model.vocab_size))
        throw UsageError(fmt::format("eval: dataset {}: window {} holds token id {}, outside the vocabulary of model '{}' "
                                     "({}): tokenized with another tokenizer?",
                                     prefix, w, t, cfg.model.name, cfg.model.vocab_size));
  }

  const bool cuda = a.device == "cuda" || (a.device == "auto" && train::cuda_training_available());
  if (a.device == "cuda" && !train::cuda_training_available())
    throw UsageError("eval: --device cuda: no GPU visible, or this keel was built without CUDA (use --device cpu)");
  if (cuda && !a.logprobs.empty())
    throw UsageError("eval: --logprobs is computed on the CPU path only: add --device cpu (the GPU backend keeps no "
                     "per-token values)");
  set_cpu_threads(cfg.kernels.cpu_threads);
  ops::set_moe_lanes(cfg.kernels.moe_lanes);
  const train::OptimizerConfig optimizer(cfg.adamw, cfg.muon);
  std::unique_ptr<train::TrainBackend> backend =
      cuda ? train::make_cuda_backend(cfg.model, cfg.model_options, optimizer)
           : train::make_cpu_backend(cfg.model, cfg.model_options, optimizer);
  train::LoadedWeights got = train::load_model_weights(reader.dir(), cfg.model);
  train::TrainState st = std::move(got.state);
  const train::StateSlice slice = backend->state_slice();
  st.shard_begin = slice.shard_begin, st.shard_end = slice.shard_end;
  st.expert_begin = slice.expert_begin, st.expert_end = slice.expert_end;
  st.adam_m.assign(static_cast<std::size_t>(slice.moments()), 0.f);
  st.adam_v.assign(st.adam_m.size(), 0.f);
  if (!got.router_bias) st.router_bias = model::initial_router_biases(cfg.model);
  backend->set_state(st);

  std::FILE* out = nullptr;
  if (!a.logprobs.empty()) {
    out = std::fopen(a.logprobs.c_str(), "w");
    if (!out) throw UsageError(fmt::format("eval: --logprobs {}: {}", a.logprobs, std::strerror(errno)));
    std::fprintf(out, "# keel eval: checkpoint %s, data %s, windows of %lld + 1 tokens\n", got.dir.c_str(), prefix.c_str(),
                 static_cast<long long>(L));
    std::fprintf(out, "# window\tposition\ttarget\tlogprob%s\n", a.top_k > 0 ? "\ttop (id:logprob, most likely first)" : "");
  }
  std::printf("model %s: checkpoint %s (%s); device %s\n", cfg.model.name.c_str(), got.dir.c_str(), got.description.c_str(),
              backend->device().c_str());
  std::printf("data %s: %lld windows of %lld + 1 tokens (%s), micro-batches of %lld\n", prefix.c_str(),
              static_cast<long long>(windows), static_cast<long long>(L),
              train_eval ? "keel train's eval samples: eval.batches x micro_batch, seed data.seed + 1"
                         : "in order, each window's last token the next one's first",
              static_cast<long long>(B));
  std::fflush(stdout);

  const std::int64_t N = B * L, total = windows * L;
  std::vector<std::uint32_t> inputs(static_cast<std::size_t>(N));
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
  std::vector<float> lp(out ? static_cast<std::size_t>(N) : 0), top_lp(out ? static_cast<std::size_t>(N * a.top_k) : 0);
  std::vector<std::int32_t> top_ids(top_lp.size());
  const train::MoeTransformer* cpu = out ? backend->cpu_model() : nullptr;
  if (out && !cpu) throw UsageError("eval: --logprobs needs the CPU backend (--device cpu)");
  const bool tty = isatty(fileno(stderr));
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto last_note = t0;
  double sum = 0;
  std::int64_t done = 0;
  for (std::int64_t b = 0; b < batches; ++b) {
    std::int64_t valid = 0;
    for (std::int64_t r = 0; r < B; ++r) {
      const std::int64_t w = b * B + r;
      if (w < windows) {
        sampler.sample(static_cast<std::uint64_t>(w), row.data());
        for (std::int64_t t = 0; t < L; ++t) {
          inputs[r * L + t] = row[t];
          targets[r * L + t] = static_cast<std::int32_t>(row[t + 1]);
        }
        valid += L;
      } else {  // the last micro-batch's missing windows: ignored targets
        std::fill(inputs.begin() + r * L, inputs.begin() + (r + 1) * L, 0u);
        std::fill(targets.begin() + r * L, targets.begin() + (r + 1) * L, -1);
      }
    }
    const double ce = backend->forward(inputs.data(), targets.data()).ce;  // mean over the valid targets
    if (!std::isfinite(ce)) fail("eval: micro-batch {} gave a non-finite CE ({})", b, ce);
    sum += ce * static_cast<double>(valid);
    done += valid;
    if (out) {
      cpu->token_logprobs(a.top_k, lp.data(), top_ids.data(), top_lp.data());
      for (std::int64_t r = 0; r < B && b * B + r < windows; ++r)
        for (std::int64_t t = 0; t < L; ++t) {
          const std::int64_t i = r * L + t;
          std::fprintf(out, "%lld\t%lld\t%d\t%.6f", static_cast<long long>(b * B + r), static_cast<long long>(t + 1),
                       targets[i], lp[i]);
          for (int k = 0; k < a.top_k; ++k)
            std::fprintf(out, "%s%d:%.6f", k ? " " : "\t", top_ids[i * a.top_k + k], top_lp[i * a.top_k + k]);
          std::fputc('\n', out);
        }
    }
    backend->reset_load();
    const auto now = clock::now();
    const bool last = b + 1 == batches;
    if (tty || last || std::chrono::duration<double>(now - last_note).count() >= 10) {
      const double s = std::chrono::duration<double>(now - t0).count();
      std::fprintf(stderr, "%seval: %s / %s tokens (%.0f%%), batch %lld / %lld, %.1f s%s", tty ? "\r" : "",
                   human(double(done)).c_str(), human(double(total)).c_str(), 100.0 * double(done) / double(total),
                   static_cast<long long>(b + 1), static_cast<long long>(batches), s, tty && !last ? "" : "\n");
      last_note = now;
    }
  }
  if (out && std::fclose(out) != 0) throw UsageError(fmt::format("eval: --logprobs {}: write failed", a.logprobs));
  const double secs = std::chrono::duration<double>(clock::now() - t0).count();
  const double mean = sum / static_cast<double>(done);
  std::printf("eval: %lld tokens in %lld batches: mean CE %.6f, perplexity %.4f (%.0f tokens/s)\n",
              static_cast<long long>(done), static_cast<long long>(batches), mean, std::exp(mean),
              secs > 0 ? double(done) / secs : 0.0);
  if (out) std::printf("per-token log-probabilities: %s\n", a.logprobs.c_str());
}

}  // namespace

void add_command(CLI::App& app) {
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "eval", "Score a checkpoint on a dataset without training: mean cross-entropy, perplexity, per-token log-probabilities");
  cmd->add_option("checkpoint", a->checkpoint, "keel checkpoint: a checkpoint.dir root (its latest) or a step directory")
      ->required();
  cmd->add_option("--data", a->data,
                  "Indexed dataset PREFIX (keel data tokenize), read in order; default: the checkpoint config's "
                  "eval.prefix, with keel train's eval samples");
  cmd->add_option("--config", a->config, "Train config (YAML) instead of the one saved in the checkpoint");
  cmd->add_option("--model", a->model, "Model YAML: the model of a checkpoint without a saved train config (imported weights)");
  cmd->add_option("--seq-length", a->seq_length, "Tokens per window, plus one (0: the config's data.seq_length)")
      ->capture_default_str();
  cmd->add_option("--micro-batch", a->micro_batch, "Windows per forward (0: the config's batch.micro_batch)")
      ->capture_default_str();
  cmd->add_option("--max-batches", a->max_batches, "Score at most N micro-batches (0: all)")->capture_default_str();
  cmd->add_option("--logprobs", a->logprobs, "Write every scored token's log-probability to this file (TSV; CPU only)");
  cmd->add_option("--top-k", a->top_k, "With --logprobs: also the k most likely ids per token and their log-probabilities")
      ->capture_default_str();
  cmd->add_option("--device", a->device, "auto (cuda when a GPU is visible and keel has CUDA), cpu (fp32) or cuda (bf16)")
      ->capture_default_str();
  cmd->callback([a] { run(*a); });
}

}  // namespace keel::eval

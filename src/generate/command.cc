#include "generate/command.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fileio.h"
#include "common/host.h"
#include "common/process.h"
#include "data/tokenizer.h"
#include "generate/cuda_decoder.h"
#include "generate/generate.h"
#include "model/config.h"
#include "train/train_checkpoint.h"
#include "train/train_config.h"

namespace keel::generate {
namespace {

struct Args {
  std::string checkpoint, model, config, prompt, prompt_file, tokenizer = "byte", device = "auto";
  int max_new = 32, top_k = 0;
  double temperature = 0.0, init_std = 0.02;
  std::uint64_t seed = 1, init_seed = 1234;
  std::vector<int> batch{1};
  bool ignore_eos = false, bos = false, bench = false, print_ids = false;
};

// --device: cuda when asked, or with auto when keel has CUDA, a GPU is visible and the GPU path
// takes the model; else the CPU reference.
std::unique_ptr<Decoder> make_decoder(const std::string& device, ModelWeights weights,
                                      std::unique_ptr<InferenceModel>& cpu_model) {
  bool cuda = device == "cuda";
  if (device == "auto") cuda = cuda_decoder_available() && cuda_decoder_unsupported(weights.config).empty();
  if (cuda) return make_cuda_decoder(std::move(weights));
  cpu_model = std::make_unique<InferenceModel>(std::move(weights));
  return std::make_unique<CpuDecoder>(*cpu_model);
}

ModelWeights load_weights(const Args& a) {
  if (!a.model.empty() && !a.config.empty()) throw UsageError("generate: give --model or --config, not both");
  std::optional<ModelWeights> named;  // the model --model / --config name (its config; no weights yet)
  if (!a.model.empty() || !a.config.empty()) {
    named.emplace();
    if (!a.model.empty()) {
      named->config = model::load_model_config(a.model);
    } else {
      const train::TrainConfig tc = train::load_train_config(a.config);
      named->config = tc.model;
      named->renormalize_gates = tc.model_options.renormalize_gates;
    }
  }
  if (a.checkpoint.empty()) {
    if (!named)
      throw UsageError("generate: give a model: a checkpoint directory, --model MODEL.yaml or --config TRAIN.yaml "
                       "(the last two alone: freshly initialized weights; with a checkpoint of imported weights: its model)");
    return fresh_weights(named->config, named->renormalize_gates, a.init_std, a.init_seed);
  }
  if (!train::is_ckpt_directory(a.checkpoint))
    throw UsageError(fmt::format("generate: {} is not a keel checkpoint (expected a checkpoint.dir root with `latest`, "
                                 "or a step directory with metadata.json)",
                                 a.checkpoint));
  return load_checkpoint_weights(a.checkpoint, named);
}

// The model YAML and tokenizer loaders read through std::filebuf, whose error for a directory
// ("basic_filebuf::underflow error reading the file") names no file: refuse one here, by name.
// `given`: the option as the user wrote it ("--tokenizer spm:/tmp"), `path` the file in it.
void require_not_directory(const std::string& given, const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UsageError(fmt::format("generate: {}: Is a directory (expected a file)", given));
}

// Fresh weights only serve smoke and latency runs; their std must be a number that gives a
// working network. Trained models init around 0.02; beyond 1 every matrix is already larger than
// the normalized activations it multiplies, and large stds (1e30) overflow fp32 in the first GEMMs.
void check_init_std(double std) {
  if (!std::isfinite(std) || std < 0 || std > 1)
    throw UsageError(fmt::format("generate: --init-std must be a finite number in [0, 1], got {}", std));
}

// A lower bound on the memory one batch size needs: the k/v caches (elem_bytes per value) of
// every position, plus the fp32 work of the prefill's B x prompt rows (the residual streams and
// norms, q/k/v and attention, the dense MLP or the routed experts' rows) and the logits (the
// decoder's and the sampler's copy). In double: an absurd --batch x positions overflows int64.
// Not an exact budget: enough to refuse in one line, before anything is printed or allocated, a
// run that cannot fit (a failed allocation mid-run was a bare "std::bad_alloc", or the kernel's
// OOM killer).
struct MemoryNeed {
  double cache = 0, work = 0;
  double total() const { return cache + work; }
};
MemoryNeed memory_need(const model::ModelConfig& cfg, int batch, std::int64_t prompt, std::int64_t positions,
                       int elem_bytes) {
  const double D = cfg.hidden, qkv = (2.0 * cfg.heads + 2.0 * cfg.kv_heads) * cfg.head_dim;
  const double mlp = std::max(3.0 * cfg.ffn_hidden, cfg.top_k * (2.0 * D + 3.0 * cfg.expert_hidden));
  const double prefill_rows = double(batch) * double(std::max<std::int64_t>(prompt, 1));
  MemoryNeed m;
  m.cache = double(batch) * double(positions) * 2.0 * cfg.layers * cfg.kv_heads * cfg.head_dim * elem_bytes;
  m.work = (prefill_rows * (12.0 * D + qkv + mlp) + double(batch) * 2.0 * double(cfg.vocab_size)) * sizeof(float);
  return m;
}

void check_memory(const model::ModelConfig& cfg, const std::vector<int>& batches, std::int64_t prompt,
                  std::int64_t positions, const std::string& device) {
  // Up front: a failed allocation mid-run gave a bare "std::bad_alloc" after the header.
  const double have = static_cast<double>(host_physical_bytes());
  const int elem_bytes = device == "cpu" ? 4 : 2;  // fp32 caches on the CPU, bf16 on the GPU
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  for (int b : batches) {
    const MemoryNeed need = memory_need(cfg, b, prompt, positions, elem_bytes);
    if (have > 0 && need.total() > have)
      throw UsageError(fmt::format(
          "generate: batch {} x {} positions needs at least {:.1f} GiB (KV cache {:.1f} GiB, logits and activations "
          "{:.1f} GiB), more than this machine's {:.1f} GiB of memory: lower --batch, the prompt or --max-new-tokens",
          b, positions, need.total() / kGiB, need.cache / kGiB, need.work / kGiB, have / kGiB));
  }
}

// Decoded text for the terminal: printed with its length (a NUL byte would end a C string
// there) and every control byte but newline and tab escaped as \xNN, so a prompt or a model
// emitting raw bytes cannot hide text or drive the terminal.
std::string printable(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f)
      out += fmt::format("\\x{:02x}", c);
    else
      out += ch;
  }
  return out;
}

// A latency column of the table: "-" where nothing was measured (no decode step ran: -n 1, or
// every sequence stopped at EOS on its first token), never a 0 that reads as a time.
std::string cell(bool measured, double value, int width, int decimals) {
  return measured ? fmt::format("{:{}.{}f}", value, width, decimals) : fmt::format("{:>{}}", "-", width);
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * double(v.size() - 1) + 0.5)];
}

void run(const Args& a) {
  if (a.max_new < 1) throw UsageError(fmt::format("generate: --max-new-tokens must be >= 1, got {}", a.max_new));
  // NaN compares false both ways: `< 0` alone let -t nan through (it then picked the least likely token).
  if (!std::isfinite(a.temperature) || a.temperature < 0)
    throw UsageError(fmt::format("generate: --temperature must be a finite number >= 0, got {}", a.temperature));
  if (a.top_k < 0) throw UsageError(fmt::format("generate: --top-k must be >= 0, got {}", a.top_k));
  if (a.top_k > 0 && a.temperature == 0)
    throw UsageError("generate: --top-k applies to sampling, but temperature 0 is greedy: give --temperature > 0 too");
  check_init_std(a.init_std);
  if (!a.model.empty()) require_not_directory("--model " + a.model, a.model);
  if (!a.config.empty()) require_not_directory("--config " + a.config, a.config);
  if (a.tokenizer.starts_with("spm:")) require_not_directory("--tokenizer " + a.tokenizer, a.tokenizer.substr(4));
  for (int b : a.batch)
    if (b < 1) throw UsageError(fmt::format("generate: --batch sizes must be >= 1, got {}", b));
  if (!a.prompt.empty() && !a.prompt_file.empty()) throw UsageError("generate: give --prompt or --prompt-file, not both");
  if (a.device != "auto" && a.device != "cpu" && a.device != "cuda")
    throw UsageError(fmt::format("generate: --device must be auto, cpu or cuda, got '{}'", a.device));
  const std::unique_ptr<data::Tokenizer> tok = data::make_tokenizer(a.tokenizer);
  ModelWeights weights = load_weights(a);
  const model::ModelConfig cfg = weights.config;
  if (static_cast<std::int64_t>(tok->vocab_size()) > cfg.vocab_size)
    throw UsageError(fmt::format("generate: tokenizer {} has {} ids, model '{}' only {}", tok->name(), tok->vocab_size(),
                                 cfg.name, cfg.vocab_size));
  const std::string text = a.prompt_file.empty() ? a.prompt : read_file(a.prompt_file);
  std::vector<std::uint32_t> prompt;
  if (a.bos && tok->bos()) prompt.push_back(*tok->bos());
  const auto enc = tok->encode(text);
  prompt.insert(prompt.end(), enc.begin(), enc.end());
  // Training documents end with EOS (data tokenize --append-eos), so an empty prompt starts
  // where a new document would.
  if (prompt.empty()) {
    if (!tok->eos()) throw UsageError("generate: empty prompt and the tokenizer has no EOS to start from");
    prompt.push_back(*tok->eos());
  }
  // The same check as make_cache, before anything is printed.
  const std::int64_t positions = static_cast<std::int64_t>(prompt.size()) + a.max_new - 1;
  if (cfg.max_seq_len > 0 && positions > cfg.max_seq_len)
    throw UsageError(fmt::format("generate: prompt + new tokens = {} positions exceeds model '{}' max_seq_len {}", positions,
                                 cfg.name, cfg.max_seq_len));
  if (positions > std::numeric_limits<int>::max())
    throw UsageError(fmt::format("generate: prompt + new tokens = {} positions, more than a cache holds ({})", positions,
                                 std::numeric_limits<int>::max()));
  check_memory(cfg, a.batch, static_cast<std::int64_t>(prompt.size()), positions, a.device);
  const std::string source = weights.source;
  std::unique_ptr<InferenceModel> cpu_model;
  const std::unique_ptr<Decoder> decoder = make_decoder(a.device, std::move(weights), cpu_model);
  Decoder& model = *decoder;

  const int moe = model::moe_layer_count(cfg);
  std::string arch = fmt::format("{} layers ({})", cfg.layers, model::attention_kind_name(cfg.attention));
  if (cfg.experts > 0)
    arch += fmt::format(", {} MoE layers of {} experts top-{}{}", moe, cfg.experts, cfg.top_k,
                        cfg.router_hidden > 0 ? (cfg.router_skip_expert ? " (MLP router, skip class)" : " (MLP router)") : "");
  std::printf("model %s: %s; %s\n", cfg.name.c_str(), arch.c_str(), source.c_str());
  std::string how = a.temperature <= 0 ? std::string("greedy")
                                       : fmt::format("temperature {}, top-k {}, seed {}", a.temperature, a.top_k, a.seed);
  const bool ignore_eos = a.ignore_eos || a.bench;
  std::printf("tokenizer %s; prompt %zu tokens; up to %d new tokens, %s%s\n", tok->name().c_str(), prompt.size(), a.max_new,
              how.c_str(), ignore_eos ? ", EOS ignored" : "");
  std::printf("device %s\n", model.device().c_str());

  GenerateOptions o;
  o.max_new_tokens = a.max_new;
  o.sampling = {a.temperature, a.top_k, a.seed};
  o.allowed_vocab = tok->vocab_size();
  if (!ignore_eos) o.eos = tok->eos();
  struct Row {
    int batch;
    GenerateResult r;
  };
  std::vector<Row> rows;
  for (int b : a.batch) {
    o.batch = b;
    // Untimed warm-up at this batch size: the first call grows the workspaces and pages them in.
    GenerateOptions warm = o;
    warm.max_new_tokens = std::min(2, a.max_new);
    (void)generate(model, prompt, warm);
    rows.push_back({b, generate(model, prompt, o)});
    if (rows.size() == 1 && !a.bench) {
      std::vector<std::uint32_t> all = prompt;
      const auto& g = rows[0].r.generated[0];
      all.insert(all.end(), g.begin(), g.end());
      std::printf("--- sequence 0 of batch %d: prompt + %zu generated tokens ---\n", b, g.size());
      const std::string text = printable(tok->decode(all));
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::printf("\n---\n");
      if (a.print_ids) {
        // The token ids themselves (prompt then generated): the text hides ids the tokenizer
        // decodes to nothing or to the same bytes (reference checks compare these).
        std::string ids = "ids:";
        for (auto id : all) ids += fmt::format(" {}", id);
        std::printf("%s\n", ids.c_str());
      }
      std::fflush(stdout);
    }
  }
  std::printf("%6s %7s %6s %11s %13s %15s %14s %14s %13s\n", "batch", "prompt", "steps", "prefill_ms", "prefill_tok/s",
              "decode_ms/step", "p50_ms/step", "decode_tok/s", "cache_KiB/seq");
  for (const auto& row : rows) {
    const auto& r = row.r;
    double sum = 0;
    for (double s : r.step_seconds) sum += s;
    const std::size_t steps = r.step_seconds.size();
    const double per = steps ? sum / double(steps) : 0.0;
    const double prefill_tps = r.prefill_seconds > 0 ? double(prompt.size()) * row.batch / r.prefill_seconds : 0.0;
    const bool decoded = steps > 0 && per > 0;
    const double tps = decoded ? row.batch / per : 0.0;
    std::printf("%6d %7zu %6zu %11.3f %13.1f %s %s %s %13.1f\n", row.batch, prompt.size(), steps,
                r.prefill_seconds * 1e3, prefill_tps, cell(decoded, per * 1e3, 15, 3).c_str(),
                cell(decoded, percentile(r.step_seconds, 0.5) * 1e3, 14, 3).c_str(), cell(decoded, tps, 14, 1).c_str(),
                double(r.cache_bytes_per_sequence) / 1024.0);
  }
}

}  // namespace

void add_command(CLI::App& app) {
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "generate", "Generate text from a keel model on the GPU or the CPU (prefill + cached incremental decoding) and report latency");
  cmd->add_option("checkpoint", a->checkpoint, "keel checkpoint: a checkpoint.dir root (its latest) or a step directory; keel train's, or imported weights (with --model)");
  cmd->add_option("--model", a->model, "Model YAML (configs/*.yaml): freshly initialized weights, or the model of a checkpoint of imported weights");
  cmd->add_option("--config", a->config, "Train config (YAML): its model, freshly initialized, or the model of a checkpoint of imported weights");
  cmd->add_option("--prompt,-p", a->prompt, "Prompt text (empty: start a new document after EOS)");
  cmd->add_option("--prompt-file", a->prompt_file, "Read the prompt from a file");
  cmd->add_option("--tokenizer", a->tokenizer, "byte or spm:MODEL_FILE (the one the training data was tokenized with)")
      ->capture_default_str();
  CLI::Option* max_new = cmd->add_option("--max-new-tokens", a->max_new, "Tokens to generate per sequence")
                             ->capture_default_str();
  cmd->add_option("--temperature,-t", a->temperature, "Sampling temperature (0: greedy)")->capture_default_str();
  cmd->add_option("--top-k", a->top_k, "Sample among the k most likely tokens (0: all)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Sampling seed (each sequence of a batch draws its own stream)")->capture_default_str();
  CLI::Option* batch =
      cmd->add_option("--batch", a->batch, "Batch sizes to time, comma-separated: --batch 1,8,64 (the text is the first's)")
          ->delimiter(',')
          ->capture_default_str();
  // The old short spellings (keel's -n and -b are the benchmarks' --iters and --min, as in
  // nccl-tests): they still work, with one deprecation line (README, "Flags across commands").
  CLI::Option* old_n = cmd->add_option("-n", a->max_new, "Deprecated: --max-new-tokens")->group("");
  CLI::Option* old_b = cmd->add_option("-b", a->batch, "Deprecated: --batch")->delimiter(',')->group("");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "Decode all --max-new-tokens even past EOS (fixed-length latency runs)");
  cmd->add_option("--device", a->device, "auto (cuda when a GPU is visible and keel has CUDA), cpu (fp32) or cuda (bf16)")
      ->capture_default_str();
  cmd->add_flag("--bench", a->bench, "Latency run: --ignore-eos, and only the latency table (no text)");
  cmd->add_flag("--bos", a->bos, "Start the prompt with the tokenizer's BOS id");
  cmd->add_flag("--print-ids", a->print_ids, "After the text, print the token ids of sequence 0 (prompt + generated) on one line 'ids: ...'");
  cmd->add_option("--init-seed", a->init_seed, "Seed of the fresh weights (--model / --config)")->capture_default_str();
  cmd->add_option("--init-std", a->init_std, "Std of the fresh weights (--model / --config)")->capture_default_str();
  cmd->callback([a, old_n, old_b, max_new, batch] {
    if (old_n->count() > 0 && max_new->count() > 0)
      throw UsageError("generate: --max-new-tokens and the old -n both given: give --max-new-tokens only");
    if (old_b->count() > 0 && batch->count() > 0)
      throw UsageError("generate: --batch and the old -b both given: give --batch only");
    if (old_n->count() > 0) warn_deprecated_flag("generate", "-n", "--max-new-tokens", "-n is --iters in keel bench");
    if (old_b->count() > 0) warn_deprecated_flag("generate", "-b", "--batch", "-b is --min in keel bench");
    run(*a);
  });
}

}  // namespace keel::generate

#include "bench/kernels/command.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>

#include "common/error.h"
#include "common/process.h"

namespace keel::bench {

#ifndef KEEL_HAVE_CUDA
std::vector<KernelsRow> run_kernels_cuda(const KernelsOptions&) {
  throw UsageError("bench kernels: this keel was built without CUDA (the kernels are timed on a GPU)");
}
#endif

namespace {

void check(const KernelsOptions& o) {
  for (const std::string& w : o.what)
    if (w != "attention" && w != "experts" && w != "ce")
      throw UsageError(fmt::format("bench kernels: --what '{}' is not a kernel (attention, experts, ce)", w));
  for (const std::string& h : o.heads) {
    int q = 0, kv = 0;
    char colon = 0, extra = 0;
    if (std::sscanf(h.c_str(), "%d%c%d%c", &q, &colon, &kv, &extra) != 3 || colon != ':' || q < 1 || kv < 1 ||
        q % kv)
      throw UsageError(fmt::format("bench kernels: --heads '{}' is not QUERY:KV with KV dividing QUERY (e.g. 16:2)", h));
  }
  if (o.batch < 1 || o.seq < 1 || (o.head_dim != 64 && o.head_dim != 128))
    throw UsageError(fmt::format("bench kernels: --batch {} and --seq {} must be positive and --head-dim {} 64 or 128",
                                 o.batch, o.seq, o.head_dim));
  if (o.tokens < 1 || o.dim < 1 || o.ffn < 1 || o.vocab < 1 || o.experts < 1 || o.tokens % o.experts)
    throw UsageError(fmt::format("bench kernels: --tokens {}, --dim {}, --ffn {}, --vocab {}, --experts {}: each must be "
                                 "positive and the experts must divide the tokens (each gets the same share)",
                                 o.tokens, o.dim, o.ffn, o.vocab, o.experts));
  if (o.iters < 1 || o.warmup < 0)
    throw UsageError(fmt::format("bench kernels: --iters {} must be positive and --warmup {} not negative", o.iters,
                                 o.warmup));
}

int run(const KernelsOptions& o) {
  check(o);
  const std::vector<KernelsRow> rows = run_kernels_cuda(o);
  std::printf("# keel bench kernels: each kernel alone, median of %d after %d warm-up runs; TFLOP/s over model FLOPs\n",
              o.iters, o.warmup);
  std::printf("%-10s %-52s %9s %9s %9s %9s\n", "kernel", "shape", "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s");
  nlohmann::json j = {{"schema", "keel.bench.kernels/1"}, {"rows", nlohmann::json::array()}};
  for (const KernelsRow& r : rows) {
    const double ft = r.fwd_flop / (r.fwd_ms * 1e-3) / 1e12, bt = r.bwd_flop / (r.bwd_ms * 1e-3) / 1e12;
    std::printf("%-10s %-52s %9.3f %9.1f %9.3f %9.1f\n", r.kernel.c_str(), r.shape.c_str(), r.fwd_ms, ft, r.bwd_ms,
                bt);
    j["rows"].push_back({{"kernel", r.kernel},
                         {"shape", r.shape},
                         {"fwd_ms", r.fwd_ms},
                         {"bwd_ms", r.bwd_ms},
                         {"fwd_flop", r.fwd_flop},
                         {"bwd_flop", r.bwd_flop},
                         {"fwd_tflops", ft},
                         {"bwd_tflops", bt}});
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    if (!(f << j.dump(2) << "\n")) throw UsageError(fmt::format("bench kernels: cannot write '{}'", o.json));
  }
  return kExitOk;
}

}  // namespace

void add_kernels_command(CLI::App& bench) {
  auto o = std::make_shared<KernelsOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "kernels",
      "The kernels that carry a MoE step's FLOPs, each alone on one GPU at ZAYA1's shapes: causal attention, the "
      "experts' grouped SwiGLU GEMMs (balanced), the LM head fused with cross-entropy; forward and backward "
      "(bench/kernels_vs_torch.py runs PyTorch's beside them).");
  cmd->add_option("--what", o->what, "Kernels to time (attention, experts, ce)")->capture_default_str();
  cmd->add_option("--batch", o->batch, "attention: sequences")->capture_default_str();
  cmd->add_option("--seq", o->seq, "attention: tokens per sequence")->capture_default_str();
  cmd->add_option("--heads", o->heads, "attention: QUERY:KV head counts, one row each")->capture_default_str();
  cmd->add_option("--head-dim", o->head_dim, "attention: head dimension (64 or 128)")->capture_default_str();
  cmd->add_option("--tokens", o->tokens, "experts, ce: tokens")->capture_default_str();
  cmd->add_option("--dim", o->dim, "experts, ce: model width")->capture_default_str();
  cmd->add_option("--ffn", o->ffn, "experts: each expert's hidden width")->capture_default_str();
  cmd->add_option("--experts", o->experts, "experts: experts (top-1, each gets tokens / experts rows)")
      ->capture_default_str();
  cmd->add_option("--vocab", o->vocab, "ce: vocabulary")->capture_default_str();
  cmd->add_option("-n,--iters", o->iters, "Timed runs (the median is reported)")->capture_default_str();
  cmd->add_option("-w,--warmup", o->warmup, "Untimed runs first")->capture_default_str();
  cmd->add_option("--json", o->json, "Write the rows as JSON (schema keel.bench.kernels/1)");
  cmd->callback([o] { set_exit_code(run(*o)); });
}

}  // namespace keel::bench

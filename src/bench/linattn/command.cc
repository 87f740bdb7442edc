#include "bench/linattn/command.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <memory>

#include "common/error.h"
#include "common/process.h"

namespace keel::bench {

#ifndef KEEL_HAVE_CUDA
std::vector<LinattnRow> run_linattn_cuda(const LinattnOptions&) {
  throw UsageError("bench linattn: this keel was built without CUDA (the op is timed on a GPU)");
}
#endif

namespace {

int run(const LinattnOptions& o) {
  if (o.batch < 1 || o.heads < 1 || o.kv_heads < 1 || o.heads % o.kv_heads || o.head_dim < 1 || o.iters < 1 ||
      o.warmup < 0)
    throw UsageError(fmt::format("bench linattn: batch {}, heads {} over kv heads {}, head_dim {}, iters {}: each must "
                                 "be positive and kv heads must divide heads",
                                 o.batch, o.heads, o.kv_heads, o.head_dim, o.iters));
  for (const std::int64_t s : o.seqs)
    if (s < 1) throw UsageError(fmt::format("bench linattn: --seq {} must be positive", s));
  const std::vector<LinattnRow> rows = run_linattn_cuda(o);
  std::printf("# keel bench linattn: causal linear attention (ops/cuda/linear_attention.h), batch %d, %d heads over %d "
              "kv heads of %d, %s; median of %d\n",
              o.batch, o.heads, o.kv_heads, o.head_dim, o.decay ? "RetNet decay" : "no decay", o.iters);
  std::printf("%10s %12s %14s %12s\n", "seq", "fwd ms", "fwd+bwd ms", "TFLOP/s");
  nlohmann::json j = {{"schema", "keel.bench.linattn/1"}, {"batch", o.batch},     {"heads", o.heads},
                      {"kv_heads", o.kv_heads},           {"head_dim", o.head_dim}, {"decay", o.decay},
                      {"rows", nlohmann::json::array()}};
  for (const LinattnRow& r : rows) {
    std::printf("%10lld %12.3f %14.3f %12.1f\n", static_cast<long long>(r.seq), r.fwd_ms, r.fwd_bwd_ms,
                r.tflops_fwd_bwd);
    j["rows"].push_back({{"seq", r.seq}, {"fwd_ms", r.fwd_ms}, {"fwd_bwd_ms", r.fwd_bwd_ms},
                         {"tflops_fwd_bwd", r.tflops_fwd_bwd}});
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    if (!(f << j.dump(2) << "\n")) throw UsageError(fmt::format("bench linattn: cannot write '{}'", o.json));
  }
  return kExitOk;
}

}  // namespace

void add_linattn_command(CLI::App& bench) {
  auto o = std::make_shared<LinattnOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "linattn",
      "Chunked causal linear attention (LASP-2's layers) on one GPU: forward and forward + backward of the op alone, "
      "on random bf16 q, k, v, per sequence length (bench/linear_attention_vs_fla.py runs flash-linear-attention "
      "beside it).");
  cmd->add_option("--seq", o->seqs, "Sequence lengths (tokens per sequence)")->capture_default_str();
  cmd->add_option("--batch", o->batch, "Sequences")->capture_default_str();
  cmd->add_option("--heads", o->heads, "Query heads")->capture_default_str();
  cmd->add_option("--kv-heads", o->kv_heads, "Key/value heads (memory states)")->capture_default_str();
  cmd->add_option("--head-dim", o->head_dim, "Head dimension")->capture_default_str();
  cmd->add_flag("--decay", o->decay, "RetNet's per-head decay (else none)");
  cmd->add_option("-n,--iters", o->iters, "Timed runs (the median is reported)")->capture_default_str();
  cmd->add_option("-w,--warmup", o->warmup, "Untimed runs first")->capture_default_str();
  cmd->add_option("--json", o->json, "Write the rows as JSON (schema keel.bench.linattn/1)");
  cmd->callback([o] { set_exit_code(run(*o)); });
}

}  // namespace keel::bench

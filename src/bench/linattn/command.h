// `keel bench linattn`: the chunked causal linear attention op (ops/cuda/linear_attention.h) timed
// alone, forward and forward + backward, at the shapes of a linear-attention layer; the numbers
// bench/linear_attention_vs_fla.py sets beside flash-linear-attention's kernels.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace keel::bench {

struct LinattnOptions {
  std::vector<std::int64_t> seqs{8192};
  int batch = 1, heads = 16, kv_heads = 16, head_dim = 128, iters = 20, warmup = 3;
  bool decay = false;
  std::string json;
};

struct LinattnRow {
  std::int64_t seq = 0;
  double fwd_ms = 0, fwd_bwd_ms = 0;  // medians
  double tflops_fwd_bwd = 0;          // model FLOPs (docs/size.md's count, x3) over fwd_bwd_ms
};

// CUDA builds with a GPU: the timed rows; otherwise throws keel::UsageError saying why.
std::vector<LinattnRow> run_linattn_cuda(const LinattnOptions& o);

void add_linattn_command(CLI::App& bench);

}  // namespace keel::bench

// `keel bench kernels`: the three kernels that carry most of a MoE training step's FLOPs, each
// timed alone on one GPU at the ZAYA1 shapes (issue 33's kernel table), forward and backward:
//   attention  causal flash attention (ops/cuda/attention.h), per (query heads, kv heads) pair;
//   experts    the experts' SwiGLU GEMMs of one MoE layer on expert-major rows, every expert
//              the same share of the tokens (ops/cuda/moe.h experts_forward/experts_backward);
//   ce         the LM head fused with cross-entropy (ops/cuda/cross_entropy.h), with the logits
//              kept in bf16 (what keel train does when they fit) and chunked.
// bench/kernels_vs_torch.py sets PyTorch's kernels beside these numbers on the same shapes.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace keel::bench {

struct KernelsOptions {
  std::vector<std::string> what{"attention", "experts", "ce"};
  // attention
  int batch = 4, seq = 4096, head_dim = 128;
  std::vector<std::string> heads{"16:16", "16:2", "8:2"};  // query heads:kv heads
  // experts (top-1, balanced) and ce
  std::int64_t tokens = 8192, dim = 2048, ffn = 2048, vocab = 262272;
  int experts = 16;
  int iters = 20, warmup = 3;
  std::string json;
};

struct KernelsRow {
  std::string kernel;  // attention, experts, ce
  std::string shape;   // the extents, as words
  double fwd_ms = 0, bwd_ms = 0;          // medians, each pass timed alone
  double fwd_flop = 0, bwd_flop = 0;      // model FLOPs of each pass (no recomputation counted)
};

// CUDA builds with a GPU: the timed rows; otherwise throws keel::UsageError saying why.
std::vector<KernelsRow> run_kernels_cuda(const KernelsOptions& o);

void add_kernels_command(CLI::App& bench);

}  // namespace keel::bench

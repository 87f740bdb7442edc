// What a GPU block asks a parallel scheme to do: its runners, handed to it by the plan
// (parallel/plan_cuda.h) built from the mesh. At degree 1 every runner is the local op, so block
// code is the same at every degree; a scheme is a set of runners in src/parallel/ (docs/
// architecture.md, "Adding a parallel scheme"). The CPU twin is blocks/runners.h.
//
//   LinearRunner   the tensor-parallel boundary of a sub-block (Megatron's f and g): what the
//                  column-parallel projections read, and how the row-parallel projection's
//                  partial output becomes the block output; and the same in backward.
//   AttentionCore  how this rank's tokens sit in their sequences (ops/cuda/sequence_split.h):
//                  causal attention of its queries over the whole sequence, and the halos of
//                  CCA's convolutions (context parallelism gathers the keys and values and
//                  fetches halos from the neighbouring ranks; TSP broadcasts head shards).
//   ExpertRunner   where a routed layer's experts run (ops/cuda/moe.h; expert parallelism:
//                  parallel/expert_parallel_cuda.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/cuda/common.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/sequence_split.h"

namespace keel::blocks::cuda {

using ops::cuda::bf16;

class LinearRunner {
 public:
  virtual ~LinearRunner() = default;
  // The rows of the residual stream this rank holds for a block of `tokens` rows: tokens, or
  // under sequence parallelism tokens / T.
  virtual std::int64_t rows(std::int64_t tokens) const { return tokens; }
  // Forward, before the column-parallel projections: the rows they read (tokens x width bf16)
  // from this rank's rows(tokens) rows x. Degree 1: x itself; sequence parallelism all-gathers.
  virtual const bf16* enter(const bf16* x, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {
    return x;
  }
  // True when the row-parallel output projection's result is the block output as it stands,
  // so it may add into the residual stream inside its GEMM (beta = 1). Degree 1: true.
  virtual bool output_is_whole() const { return true; }
  // Where the row-parallel projection writes its (partial) tokens x width output for a block
  // output y of rows(tokens) rows: y itself, or under sequence parallelism a buffer of the
  // runner's.
  virtual bf16* out(bf16* y, std::int64_t tokens, std::int64_t width) { return y; }
  virtual float* out(float* y, std::int64_t tokens, std::int64_t width) { return y; }
  // Forward, after the row-parallel projection wrote `partial` (= out(y)): the block output in
  // y, summed over the group (all-reduced in place, or reduce-scattered into this rank's rows).
  // Degree 1: nothing to do.
  virtual void exit(bf16* partial, bf16* y, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {}
  virtual void exit(float* partial, float* y, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {}
  // Backward, the gradient of the block output (rows(tokens) rows) as the row-parallel
  // projection reads it (tokens rows). Degree 1: dy itself; sequence parallelism all-gathers.
  virtual const bf16* exit_backward(const bf16* dy, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {
    return dy;
  }
  virtual const float* exit_backward(const float* dy, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {
    return dy;
  }
  // Backward, where the column-parallel projections write their input gradient (tokens rows,
  // summed over them) for the block input's gradient dx (rows(tokens) rows): dx itself, or under
  // sequence parallelism a buffer of the runner's.
  virtual float* dx_out(float* dx, std::int64_t tokens, std::int64_t width) { return dx; }
  virtual bf16* dx_out(bf16* dx, std::int64_t tokens, std::int64_t width) { return dx; }
  // That gradient (= dx_out(dx)) made the gradient of the block input in dx, summed over the
  // group. Degree 1: nothing to do.
  virtual void enter_backward(float* partial, float* dx, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {}
  virtual void enter_backward(bf16* partial, bf16* dx, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {}
};

using AttentionCore = ops::cuda::SequenceSplit;

// The degree-1 runners (stateless; shared).
LinearRunner& local_linear();
AttentionCore& local_attention();

// What one layer's blocks run on. experts is null for a dense layer, or for a routed layer
// whose experts all run here through ops/cuda/moe.h directly.
struct LayerRunners {
  LinearRunner* attn_linear = &local_linear();
  LinearRunner* mlp_linear = &local_linear();
  AttentionCore* attention = &local_attention();
  ops::cuda::moe::ExpertRunner* experts = nullptr;
  // TSP with expert parallelism: weight shard r's pass runs its experts on shard_experts[r] (a
  // runner keeps its pass's rows for backward); empty otherwise.
  std::vector<ops::cuda::moe::ExpertRunner*> shard_experts;
  ops::cuda::moe::ExpertRunner* experts_of(int shard) const {
    return shard_experts.empty() ? experts : shard_experts.at(static_cast<std::size_t>(shard));
  }
};

}  // namespace keel::blocks::cuda

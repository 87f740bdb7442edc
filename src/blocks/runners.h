// What a CPU block asks a parallel scheme to do: its runners, handed to it by the plan
// (parallel/plan.h) built from the mesh. At degree 1 every runner is the local op, so block code
// is the same at every degree; a scheme is a set of runners in src/parallel/ (docs/
// architecture.md, "Adding a parallel scheme"). The GPU twin is blocks/cuda/runners.h.
//
//   LinearRunner   the tensor-parallel boundary of a sub-block (Megatron's f and g): what the
//                  column-parallel projections read, and how the row-parallel projection's
//                  partial output becomes the block output; and the same in backward.
//   AttentionCore  how this rank's tokens sit in their sequences (ops/sequence_split.h): causal
//                  softmax attention of its queries over the whole sequence, and the halos of
//                  CCA's convolutions (context parallelism gathers the keys and values and
//                  fetches halos from the neighbouring ranks; TSP broadcasts head shards).
//   TokenGroup     the ranks whose tokens make up one micro-batch's sequences (context
//                  parallelism): per-micro-batch statistics (the linear router's expert counts
//                  behind its balancing loss) are summed over them.
//   ExpertRunner   where a routed layer's experts run (ops/moe.h; expert parallelism:
//                  parallel/expert_parallel.h).
#pragma once

#include "ops/moe.h"
#include "ops/sequence_split.h"
#include "tensor/tensor.h"

namespace keel::blocks {

class LinearRunner {
 public:
  virtual ~LinearRunner() = default;
  // Forward, before the column-parallel projections: the rows they read. Degree 1: x itself;
  // sequence parallelism gathers this rank's rows of the group into the block's [N, D].
  virtual Tensor enter(const Tensor& x) { return x; }
  // Where the row-parallel projection writes its (partial) output, for a block output y: y
  // itself, or under sequence parallelism a [N, D] buffer of the runner's.
  virtual Tensor out(const Tensor& y) { return y; }
  // After the row-parallel projection wrote `partial` (= out(y)): the block output in y (summed
  // over the group: all-reduced in place, or reduce-scattered into this rank's rows). Degree 1:
  // nothing to do.
  virtual void exit(const Tensor& partial, const Tensor& y) {}
  // Backward: the gradient of the block output as the row-parallel projection reads it (sequence
  // parallelism gathers it). Degree 1: dy itself.
  virtual Tensor exit_backward(const Tensor& dy) { return dy; }
  // Where the column-parallel projections write their input gradient (summed over them), for
  // the block input's gradient dx: dx itself, or a [N, D] buffer of the runner's.
  virtual Tensor dx_out(const Tensor& dx) { return dx; }
  // That gradient (= dx_out(dx)) made the gradient of the block input in dx, summed over the
  // group. Degree 1: nothing to do.
  virtual void enter_backward(const Tensor& partial, const Tensor& dx) {}
};

using AttentionCore = ops::SequenceSplit;

class TokenGroup {
 public:
  virtual ~TokenGroup() = default;
  // Ranks sharing each sequence of the micro-batch (1: this rank has whole sequences).
  virtual int size() const { return 1; }
  // Sums x[0..n) over the group, in place (every rank gets the sums).
  virtual void sum(std::int64_t* x, int n) {}
};

// The degree-1 runners (stateless; shared).
LinearRunner& local_linear();
AttentionCore& local_attention();
TokenGroup& local_tokens();

// What one layer's blocks run on. experts is null for a dense layer, or for a routed layer whose
// experts all run here through ops/moe.h directly.
struct LayerRunners {
  LinearRunner* attn_linear = &local_linear();
  LinearRunner* mlp_linear = &local_linear();
  AttentionCore* attention = &local_attention();
  ops::moe::ExpertRunner* experts = nullptr;
  TokenGroup* tokens = &local_tokens();
};

}  // namespace keel::blocks

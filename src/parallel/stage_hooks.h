// What a training model tells a data-parallel schedule as its forward and backward run: the
// stages of its flat parameter layout (model::param_stage: the embedding, each layer's attention
// part and MLP part, what follows the layers), in the order it reaches them. The model calls the
// hooks at stage boundaries only; the overlapped ZeRO-1 step (zero1_overlap_cuda.h) implements
// them to wait for parameters and to reduce gradients while the model computes. At one rank,
// or with the classic step, nothing happens (no_stage_hooks()).
#pragma once

#include <cstdint>

namespace keel::parallel {

class StageHooks {
 public:
  virtual ~StageHooks() = default;
  // Forward begins (before the embedding) and ends (after the loss).
  virtual void forward_begin() {}
  virtual void forward_end() {}
  // Forward: stage s's parameters are about to be read. Stages come in increasing order.
  virtual void before_stage(int s) {}
  // Backward: stage s's gradients are final for this step (no later backward adds to them):
  // the final stage first, then each layer's MLP part and attention part, the embedding (0)
  // last. The model calls grads_final(0) only when take_embedding_grads() declined.
  virtual void grads_final(int s) {}
  // Backward, after every layer: the expert region's gradients are final too.
  virtual void layers_done() {}
  // Backward, the embedding's gradient: this micro-batch's rows, token ids [n] and dL/d(embedding
  // output) [n, D] fp32 (device). True when the schedule adds them into the table itself (the
  // deferred scatter of the overlapped step); false: the model scatter-adds them.
  virtual bool take_embedding_grads(const std::uint32_t* tokens, const float* drows, std::int64_t n) { return false; }
};

// The hooks of a run that has no schedule to inform.
StageHooks& no_stage_hooks();

}  // namespace keel::parallel

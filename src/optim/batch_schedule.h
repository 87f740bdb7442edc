// Batch-size ramp-up and gradient accumulation, as pure functions of what has been consumed.
//
// Ramp-up (Megatron-LM's --rampup-batch-size START INCREMENT RAMP_SAMPLES, GPT-3 style): the
// global batch starts at start_batch and grows by `increment` in equal slices of the ramp:
//   n       = (target_batch - start_batch) / increment          (number of increments)
//   per     = ramp / n                                          (consumed units per increment)
//   batch(c) = min(target_batch, start_batch + floor(c / per) * increment)
// Units: batch sizes and `consumed` are both in samples (sequences) or both in tokens; the
// schedule does not care which. With ramp == 0 or start == target the batch is target_batch.
//
// Gradient accumulation: a global batch of B samples on dp data-parallel ranks with micro-batch
// mb runs accum = B / (mb * dp) micro-batches per rank per step; the per-op gradients are
// accumulated (+=, docs/ops.md) and the optimizer gets grad_scale = 1 / accum (each micro-batch
// loss a mean over its own tokens; the data-parallel reduction averages over dp).
#pragma once

#include <cstdint>

namespace keel::optim {

struct BatchRampup {
  std::int64_t start_batch = 1;
  std::int64_t target_batch = 1;
  std::int64_t increment = 1;
  std::int64_t ramp = 0;         // consumed units over which the batch ramps up
  std::int64_t multiple_of = 1;  // every batch must be a multiple (micro_batch * dp)
};

// Throws keel::Error (one line) unless 0 < start <= target, increment > 0 divides
// target - start, ramp >= 0, and start and increment are multiples of multiple_of (>= 1).
void validate(const BatchRampup& r);
// The global batch after `consumed` units (>= 0). Validates r first.
std::int64_t global_batch_at(const BatchRampup& r, std::int64_t consumed);

// Micro-batches per rank per step: global_batch / (micro_batch * dp); throws when it does not
// divide evenly or any argument is < 1.
std::int64_t accumulation_steps(std::int64_t global_batch, std::int64_t micro_batch, std::int64_t dp);

}  // namespace keel::optim

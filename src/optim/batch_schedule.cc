#include "optim/batch_schedule.h"

#include <algorithm>

#include "common/error.h"

namespace keel::optim {

void validate(const BatchRampup& r) {
  if (r.multiple_of < 1) fail("batch ramp-up: multiple_of must be >= 1, got {}", r.multiple_of);
  if (r.start_batch < 1) fail("batch ramp-up: start_batch must be >= 1, got {}", r.start_batch);
  if (r.target_batch < r.start_batch)
    fail("batch ramp-up: target_batch ({}) is below start_batch ({})", r.target_batch, r.start_batch);
  if (r.increment < 1) fail("batch ramp-up: increment must be >= 1, got {}", r.increment);
  if ((r.target_batch - r.start_batch) % r.increment != 0)
    fail("batch ramp-up: increment {} does not divide target_batch - start_batch = {}", r.increment,
         r.target_batch - r.start_batch);
  if (r.ramp < 0) fail("batch ramp-up: ramp must be >= 0, got {}", r.ramp);
  if (r.start_batch % r.multiple_of != 0)
    fail("batch ramp-up: start_batch {} is not a multiple of {} (micro_batch x dp)", r.start_batch, r.multiple_of);
  if (r.increment % r.multiple_of != 0 && r.target_batch != r.start_batch)
    fail("batch ramp-up: increment {} is not a multiple of {} (micro_batch x dp)", r.increment, r.multiple_of);
}

std::int64_t global_batch_at(const BatchRampup& r, std::int64_t consumed) {
  validate(r);
  if (consumed < 0) fail("batch ramp-up: consumed must be >= 0, got {}", consumed);
  const std::int64_t n = (r.target_batch - r.start_batch) / r.increment;
  if (n == 0 || r.ramp == 0) return r.target_batch;
  // floor(consumed / (ramp / n)) = floor(consumed * n / ramp), in exact 128-bit arithmetic.
  if (consumed >= r.ramp) return r.target_batch;
  auto k = static_cast<std::int64_t>(static_cast<__int128>(consumed) * n / r.ramp);
  return std::min(r.target_batch, r.start_batch + k * r.increment);
}

std::int64_t accumulation_steps(std::int64_t global_batch, std::int64_t micro_batch, std::int64_t dp) {
  if (global_batch < 1 || micro_batch < 1 || dp < 1)
    fail("gradient accumulation: global batch {}, micro-batch {} and dp {} must all be >= 1", global_batch,
         micro_batch, dp);
  if (global_batch % (micro_batch * dp) != 0)
    fail("gradient accumulation: global batch {} is not a multiple of micro-batch {} x dp {} = {}", global_batch,
         micro_batch, dp, micro_batch * dp);
  return global_batch / (micro_batch * dp);
}

}  // namespace keel::optim

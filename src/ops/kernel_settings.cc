#include "ops/kernel_settings.h"

#include <fmt/format.h>

#include "common/error.h"

namespace keel::ops {

#ifndef KEEL_HAVE_CUDA
void set_moe_lanes(int n) {
  if (n < 1 || n > 8) throw UsageError(fmt::format("kernels.moe_lanes {}: expected an integer in [1, 8]", n));
}
#endif

}  // namespace keel::ops

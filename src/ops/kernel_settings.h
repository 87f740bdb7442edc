// How the ops use the machine beyond their arguments: `kernels:` of keel train's config
// (train/train_config.h), set once before the first step. Neither setting changes a result, only
// speed and memory. (The CPU ops' thread count is common/parallel_for.h's.)
#pragma once

namespace keel::ops {

// Side streams the CUDA experts run on (ops/cuda/moe.h), 1 to 8 (default 4), each with its own
// 32 MiB cuBLASLt workspace; 1 runs the experts one after another on the caller's stream. A
// no-op in a build without CUDA. keel::UsageError outside [1, 8].
void set_moe_lanes(int n);

}  // namespace keel::ops

// A small parallel-for for the CPU reference ops: splits [0, n) into contiguous chunks, one
// per thread, and runs fn(begin, end) on each. Each call starts and joins its own std::threads
// (tens of microseconds), so it is only used where the work per call dwarfs that; below
// `min_per_thread` items per thread it runs inline. Chunking is static and deterministic, and
// every op writes disjoint outputs per index, so results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace keel::ops {

// How the ops use the machine: `kernels:` of keel train's config (train/train_config.h), set once
// before the first step. Neither changes a result, only speed and memory.
// Threads the CPU ops may use: set_threads(n) (0: hardware_concurrency(), the default).
int ops_threads();
void set_threads(int n);
// Side streams the CUDA experts run on (ops/cuda/moe.h), 1 to 8 (default 4); a no-op in a build
// without CUDA. keel::UsageError outside that range.
void set_moe_lanes(int n);

template <typename Fn>
void parallel_for(std::int64_t n, std::int64_t min_per_thread, Fn&& fn) {
  if (n <= 0) return;
  std::int64_t threads = std::min<std::int64_t>(ops_threads(), std::max<std::int64_t>(1, n / std::max<std::int64_t>(1, min_per_thread)));
  if (threads <= 1) {
    fn(std::int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  std::int64_t chunk = (n + threads - 1) / threads;
  for (std::int64_t t = 1; t < threads; ++t) {
    std::int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(std::int64_t{0}, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

}  // namespace keel::ops

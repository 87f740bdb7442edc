// A small parallel-for for the CPU reference ops (and the host optimizer): splits [0, n) into contiguous chunks, one
// per thread, and runs fn(begin, end) on each. Each call starts and joins its own std::threads
// (tens of microseconds), so it is only used where the work per call dwarfs that; below
// `min_per_thread` items per thread it runs inline. Chunking is static and deterministic, and
// every op writes disjoint outputs per index, so results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace keel {

// Threads the CPU code (the reference ops, the host optimizer) may use: set_cpu_threads(n)
// (kernels.cpu_threads of keel train's config, set once before the first step; 0:
// hardware_concurrency(), the default). It changes no result, only speed.
int cpu_threads();
void set_cpu_threads(int n);

template <typename Fn>
void parallel_for(std::int64_t n, std::int64_t min_per_thread, Fn&& fn) {
  if (n <= 0) return;
  std::int64_t threads = std::min<std::int64_t>(cpu_threads(), std::max<std::int64_t>(1, n / std::max<std::int64_t>(1, min_per_thread)));
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

}  // namespace keel

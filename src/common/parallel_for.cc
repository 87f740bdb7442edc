#include "common/parallel_for.h"

#include <atomic>

namespace keel {
namespace {

int all_cores() {
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

std::atomic<int> g_threads{0};  // 0: every core

}  // namespace

int cpu_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : all_cores();
}

void set_cpu_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

}  // namespace keel

#include "ops/parallel.h"

#include <cstdlib>

namespace keel::ops {

int ops_threads() {
  static const int n = [] {
    if (const char* s = std::getenv("KEEL_OPS_THREADS")) {
      int v = std::atoi(s);
      if (v >= 1) return v;
    }
    unsigned hc = std::thread::hardware_concurrency();
    return hc ? static_cast<int>(hc) : 1;
  }();
  return n;
}

}  // namespace keel::ops

// Verifies an array in host memory against stream_expected (values.h), split over a thread
// team: the CPU backend's outputs and what a GPU copied back to the host.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "bench/mem/backend.h"
#include "bench/mem/thread_team.h"
#include "bench/mem/values.h"

namespace keel::bench {

template <typename T>
void verify_on_host(ThreadTeam& team, int kernel, const T* out, std::uint64_t n, std::uint64_t seed, MemResult& r) {
  const double eps = std::numeric_limits<T>::epsilon() / 2;  // unit roundoff
  const double scalar = static_cast<double>(static_cast<T>(kStreamScalar));
  std::vector<std::uint64_t> wrong(static_cast<std::size_t>(team.size()), 0);
  std::vector<std::uint64_t> first(static_cast<std::size_t>(team.size()), ~0ull);
  team.run([&](int t, int nt) {
    std::uint64_t lo, hi;
    ThreadTeam::slice(n, t, nt, &lo, &hi);
    for (std::uint64_t i = lo; i < hi; ++i) {
      const StreamExpectation e = stream_expected(kernel, seed, i, r.runs, scalar, eps);
      if (!(std::fabs(static_cast<double>(out[i]) - e.value) <= e.tolerance))
        if (wrong[static_cast<std::size_t>(t)]++ == 0) first[static_cast<std::size_t>(t)] = i;
    }
  });
  r.checked = true;
  for (std::size_t t = 0; t < wrong.size(); ++t) {
    r.wrong += wrong[t];
    if (wrong[t] && r.first_wrong.empty()) {  // members own ascending slices: the first is the smallest
      const std::uint64_t i = first[t];
      const StreamExpectation e = stream_expected(kernel, seed, i, r.runs, scalar, eps);
      r.first_wrong = fmt::format("element {}: got {:.9g}, expected {:.9g}", i, static_cast<double>(out[i]), e.value);
    }
  }
}

}  // namespace keel::bench

// The host reference for sampled GEMM outputs: a double-precision dot product of the very
// operands the library read, compared with a tolerance that follows the type's rounding.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/gemm/backend.h"

namespace keel::bench {

// Positions (batch, i, j) to check: the four corners of the first and last batch entries, then
// random ones, `count` in all (fewer when the output is smaller).
std::vector<std::array<std::int64_t, 3>> gemm_check_positions(const GemmShape& s, int count, std::uint64_t seed);

// How far a correct result may be from the exact dot product `ref` of k terms whose absolute
// values sum to `sum_abs` and whose squares sum to `sum_sq`: output rounding, input rounding
// (tf32 reads fp32 operands with 10 mantissa bits), fp32 (or fp8 tensor-core) accumulation,
// and split-k partial sums rounded to the output type before they are added.
double gemm_tolerance(GemmType t, std::int64_t k, double ref, double sum_abs, double sum_sq);

struct GemmCheckOutcome {
  int samples = 0;
  int wrong = 0;
  std::string first_wrong;   // "(b, i, j): got x, expected y, tolerance z"
  double worst_ratio = 0;    // max |error| / tolerance over samples (< 1 passes)
};

GemmCheckOutcome check_gemm(const GemmResult& r, GemmType t, std::int64_t k);

}  // namespace keel::bench

// The values `keel bench mem` fills and expects, shared by host and device code (plain C++17,
// no CUDA headers) so the GPU verifier and the CPU reference apply the same formulas.
//
// Inputs are random in [0.5, 1): never zero, distinct across elements and arrays so an
// indexing error cannot hide (BabelStream uses the constants 0.1, 0.2, 0), positive so a dot
// product has no cancellation and its sum can be checked to a tight relative tolerance, and
// exact in fp32 and fp64 so host and device see bit-identical inputs.
#pragma once

#include <cstdint>

#include "common/hash.h"

#if defined(__CUDACC__)
#define KEEL_HD __host__ __device__
#else
#define KEEL_HD
#endif

namespace keel::bench {

// BabelStream's scalar.
inline constexpr double kStreamScalar = 0.4;

enum StreamArray : int { kArrayA = 0, kArrayB = 1, kArrayC = 2 };
enum StreamKernel : int { kKernelCopy, kKernelMul, kKernelAdd, kKernelTriad, kKernelDot, kKernelNstream };


// Element i of array `which` for `seed`: 0.5 + 23 random bits / 2^24, exact in fp32.
KEEL_HD inline float stream_input(std::uint64_t seed, int which, std::uint64_t i) {
  const std::uint64_t h = keel::splitmix64(keel::splitmix64(seed * 3 + static_cast<std::uint64_t>(which)) ^ i);
  return 0.5f + static_cast<float>(h >> 41) * 0x1p-24f;
}

// The array a kernel writes (dot writes none: -1).
KEEL_HD inline int stream_output_array(int kernel) {
  switch (kernel) {
    case kKernelCopy: return kArrayC;
    case kKernelMul: return kArrayB;
    case kKernelAdd: return kArrayC;
    case kKernelTriad: return kArrayA;
    case kKernelNstream: return kArrayA;
    default: return -1;
  }
}

struct StreamExpectation {
  double value;      // exact result
  double tolerance;  // absolute
};

// What element i of the output array holds after `runs` runs of `kernel` on fresh inputs, in
// exact arithmetic, and how far a correct T-precision result may be from it (`eps` is T's
// unit roundoff; `scalar` the scalar as T holds it). Every kernel but nstream is idempotent;
// nstream (a += b + s*c) adds the same increment each run.
KEEL_HD inline StreamExpectation stream_expected(int kernel, std::uint64_t seed, std::uint64_t i, std::uint64_t runs,
                                                 double scalar, double eps) {
  const double a = stream_input(seed, kArrayA, i), b = stream_input(seed, kArrayB, i),
               c = stream_input(seed, kArrayC, i);
  switch (kernel) {
    case kKernelCopy: return {a, 0.0};
    case kKernelMul: return {scalar * c, 2 * eps * scalar * c};
    case kKernelAdd: return {a + b, 2 * eps * (a + b)};
    case kKernelTriad: return {b + scalar * c, 3 * eps * (b + scalar * c)};
    case kKernelNstream: {
      const double step = b + scalar * c;
      const double r = static_cast<double>(runs);
      // Each run rounds the increment and the sum once or twice: at most 3 eps of the running
      // value, which never exceeds the final one.
      return {a + r * step, 3 * eps * r * (a + r * step)};
    }
    default: return {0.0, 0.0};
  }
}

// A dot product of n positive terms summed in T precision along chains of at most `chain`
// terms (per-thread or per-chunk partial sums) may be off by chain * eps of the sum; add a
// tree's log2(n) levels of pairwise sums.
KEEL_HD inline double stream_dot_tolerance(double sum, std::uint64_t chain, std::uint64_t n, double eps) {
  double levels = 0;
  for (std::uint64_t x = n; x > 1; x >>= 1) levels += 1;
  return (static_cast<double>(chain) + levels + 2) * eps * sum;
}

}  // namespace keel::bench

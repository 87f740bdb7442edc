// The data every benchmarked collective moves, and the exact result it must produce.
// Inputs are small integers drawn from a hash of (seed, rank, index), scaled so that any sum
// over the participating ranks, in any order, is exactly representable in the dtype: then a
// sum must match bit for bit, and only `avg` (sum times 1/n) gets a 2-ulp tolerance, as in
// nccl-tests. Compiled for host and device so the CPU and GPU checkers share one definition.
#pragma once

#include <cstdint>

#include "common/hash.h"

#include "bench/comm/collective.h"

#if defined(__CUDACC__)
#define KEEL_HD __host__ __device__ __forceinline__
#else
#define KEEL_HD inline
#endif

namespace keel::bench {

struct ValueSpec {
  std::uint64_t seed = 0;
  int nranks = 1;
  int magnitude = 1;         // inputs lie in [-magnitude, magnitude]
  int contributing = 1;      // ranks >= this contribute zeros (only when nranks exceeds the exact range)
};

inline ValueSpec make_value_spec(std::uint64_t seed, int nranks, DType t) {
  const std::int64_t limit = dtype_exact_int_limit(t);
  ValueSpec v;
  v.seed = seed;
  v.nranks = nranks;
  std::int64_t m = limit / nranks;
  if (m > 64) m = 64;
  if (m < 1) m = 1;
  v.magnitude = static_cast<int>(m);
  v.contributing = nranks <= limit ? nranks : static_cast<int>(limit);
  return v;
}


// Element `index` of rank `rank`'s input.
KEEL_HD float input_value(const ValueSpec& v, int rank, std::uint64_t index) {
  if (rank >= v.contributing) return 0.f;
  const std::uint64_t h = keel::splitmix64(v.seed ^ keel::splitmix64(static_cast<std::uint64_t>(rank) * 0x100000001b3ull + index));
  const std::uint64_t span = 2ull * static_cast<std::uint64_t>(v.magnitude) + 1ull;
  return static_cast<float>(static_cast<std::int64_t>(h % span) - v.magnitude);
}

struct CaseGeometry {
  Collective op = Collective::kAllReduce;
  RedOp redop = RedOp::kSum;
  int root = 0;
  std::uint64_t send_count = 0;
  std::uint64_t recv_count = 0;
};

// Sum over ranks of input_value(rank, index), exact.
KEEL_HD float sum_over_ranks(const ValueSpec& v, std::uint64_t index) {
  float s = 0.f;
  for (int r = 0; r < v.nranks; ++r) s += input_value(v, r, index);
  return s;
}

// Element j of rank `rank`'s output buffer (its group rank) after the collective.
KEEL_HD float expected_output(const ValueSpec& v, const CaseGeometry& g, int rank, std::uint64_t j) {
  switch (g.op) {
    case Collective::kAllReduce: {
      const float s = sum_over_ranks(v, j);
      return g.redop == RedOp::kAvg ? s / static_cast<float>(v.nranks) : s;
    }
    case Collective::kReduceScatter: {
      const float s = sum_over_ranks(v, static_cast<std::uint64_t>(rank) * g.recv_count + j);
      return g.redop == RedOp::kAvg ? s / static_cast<float>(v.nranks) : s;
    }
    case Collective::kAllGather: {
      const std::uint64_t src = j / g.send_count;
      return input_value(v, static_cast<int>(src), j % g.send_count);
    }
    case Collective::kBroadcast: return input_value(v, g.root, j);
    case Collective::kAllToAll: {
      const std::uint64_t block = g.send_count / static_cast<std::uint64_t>(v.nranks);
      const std::uint64_t src = j / block;
      return input_value(v, static_cast<int>(src), static_cast<std::uint64_t>(rank) * block + j % block);
    }
    case Collective::kSendRecv: return input_value(v, (rank - 1 + v.nranks) % v.nranks, j);
  }
  return 0.f;
}

// The tolerance a result must meet: 0 for sums and copies, 2 ulps of the dtype for avg.
KEEL_HD float tolerance(const CaseGeometry& g, DType t, float expected) {
  const bool reduces = g.op == Collective::kAllReduce || g.op == Collective::kReduceScatter;
  if (!(reduces && g.redop == RedOp::kAvg)) return 0.f;
  const float a = expected < 0 ? -expected : expected;
  const float rel = t == DType::kBF16 ? 0.0078125f : t == DType::kFP16 ? 0.0009765625f : 1.1920929e-07f;
  const float floor = t == DType::kBF16 ? 1e-30f : t == DType::kFP16 ? 6e-8f : 1e-38f;
  return 2.f * (a * rel > floor ? a * rel : floor);
}

}  // namespace keel::bench

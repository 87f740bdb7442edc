// Device kernels that fill collective inputs and verify outputs on the GPU, so an 8 GiB
// result is checked element by element without a host copy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bench/comm/values.h"

namespace keel::bench {

struct VerifyCounters {
  unsigned long long wrong;
  unsigned long long first;  // smallest wrong index; ~0ull when none
};

// Writes input_value(spec, rank, i) for i in [0, count) into buf as `t`.
void launch_fill_inputs(void* buf, std::uint64_t count, DType t, const ValueSpec& spec, int rank, cudaStream_t s);
// Compares buf[0, count) with expected_output(spec, geom, rank, j); counts mismatches.
void launch_verify(const void* buf, std::uint64_t count, DType t, const ValueSpec& spec, const CaseGeometry& geom,
                   int rank, VerifyCounters* counters, cudaStream_t s);

}  // namespace keel::bench

// Device kernels of `keel bench mem`: the BabelStream set as 16-byte vectorized grid-stride
// loops sized to the SM count, and the fill and verify kernels that bracket every case.
// Plain C++17 (nvcc); the backend (cuda_backend_cuda.cc) is the only caller.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace keel::bench {

struct StreamVerifyCounters {
  unsigned long long wrong;
  unsigned long long first;  // smallest wrong index; ~0ull when none
};

// Threads per block, and the grid kernel `kernel` (a StreamKernel) uses for `n` elements on
// `sm_count` SMs: as many blocks as stay resident at once (the kernel's occupancy times the SM
// count), never more than the work needs, so the grid-stride loop runs in one wave.
inline constexpr int kStreamBlock = 256;
int stream_grid(int kernel, bool f64, std::uint64_t n, int sm_count);
// The grid of the fill and verify kernels.
int stream_aux_grid(std::uint64_t n, int sm_count);

// a, b, c <- stream_input(seed, array, i); any of them may be null. With `poison_c`, c is
// filled with NaN instead (copy's output), so an element a kernel skips cannot pass.
void launch_stream_fill(void* a, void* b, void* c, std::uint64_t n, bool f64, std::uint64_t seed, bool poison_c,
                        int grid, cudaStream_t s);
// One run of a StreamKernel (values.h) over n elements on `grid` blocks (stream_grid), as a
// grid-stride loop. Dot writes one partial sum per block (in T) to dot_partials, which must
// hold `grid` elements of T.
void launch_stream_kernel(int kernel, bool f64, void* a, void* b, void* c, std::uint64_t n, void* dot_partials,
                          int grid, cudaStream_t s);
// The same elementwise kernels (not dot) launched one-shot, as PyTorch's elementwise kernels
// launch: a block per Block x Unroll 16-byte vectors, no loop. Variants differ in block size,
// unroll and cache hints (plain or evict-first streaming loads/stores). Which shape streams
// fastest depends on the chip and the size, so the backend times every variant and the
// grid-stride loop, and keeps the fastest (reported as the row's launch).
inline constexpr int kStreamOneshotVariants = 4;
const char* stream_oneshot_variant_name(int variant);
void launch_stream_kernel_oneshot(int kernel, bool f64, void* a, void* b, void* c, std::uint64_t n, int variant,
                                  cudaStream_t s);
// Counts elements of `out` that are not stream_expected(kernel, seed, i, runs) within
// tolerance (adds to *counters; zero them first).
void launch_stream_verify(int kernel, bool f64, const void* out, std::uint64_t n, std::uint64_t seed,
                          std::uint64_t runs, StreamVerifyCounters* counters, int grid, cudaStream_t s);

}  // namespace keel::bench

// Device helpers around a timed GEMM: random operand fills, NaN poisoning of the output, a
// count of non-finite outputs, the gather of sampled rows and columns for the host check,
// and a spin kernel that holds the stream while timed launches queue up behind it.
// Plain C++17 (nvcc); types are GemmType values passed as int.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace keel::bench {

// Storage kinds of operands and outputs.
enum GemmStorage : int { kStoreBF16, kStoreFP16, kStoreFP8E4M3, kStoreFP32 };

// Uniform random values in [-1, 1) from (seed, i), rounded to the storage type.
void launch_gemm_fill(void* p, std::uint64_t count, int storage, std::uint64_t seed, cudaStream_t s);
void launch_gemm_poison(void* p, std::uint64_t count, int storage, cudaStream_t s);
void launch_gemm_count_nonfinite(const void* p, std::uint64_t count, int storage, unsigned long long* counter,
                                 cudaStream_t s);

// For each of `samples` positions (batch b, row i, col j) given as 3 int64 each in `pos`
// (device memory), writes row i of op(A_b) to a_out[s*k ..] and column j of op(B_b) to
// b_out[s*k ..] as float, and C_b[i, j] to c_out[s]. Row-major, batch-strided operands.
void launch_gemm_gather(const void* A, const void* B, const void* C, int in_storage, int out_storage,
                        bool a_trans, bool b_trans, std::int64_t m, std::int64_t n, std::int64_t k,
                        const std::int64_t* pos, int samples, float* a_out, float* b_out, float* c_out,
                        cudaStream_t s);

// Busy-waits about `ns` nanoseconds on the device.
void launch_spin(std::uint64_t ns, cudaStream_t s);

}  // namespace keel::bench

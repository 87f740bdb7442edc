#include "parallel/lasp2_kernels.h"

#include "common/error.h"
#include "device/cuda_check.h"

namespace keel::parallel::lasp2 {

namespace {
// One thread per (sequence, kv head, element): the walk is sequential over the 2C chunks only.
__global__ void walk_kernel(const float* __restrict__ gathered, float* __restrict__ mine, int C, int rank, int hkv,
                            long long dd, Decays decay_L, bool reverse, long long total) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const long long e = i % dd, bg = i / dd;
  const int g = static_cast<int>(bg % hkv);
  const long long b = bg / hkv;
  const long long per_rank = 2 * total;  // B * 2 runs of hkv * dd
  const float decay = decay_L.g[g];
  float x = 0.f;
  for (int step = 0; step < 2 * C; ++step) {
    const int j = reverse ? 2 * C - 1 - step : step;
    const int owner = j < C ? j : 2 * C - 1 - j, seg = j < C ? 0 : 1;
    const long long block = ((b * 2 + seg) * hkv + g) * dd + e;
    if (owner == rank) mine[block] = x;
    x = decay * x + gathered[owner * per_rank + block];
  }
}
__global__ void hop_kernel(float* __restrict__ msg, float* __restrict__ mine, const float* __restrict__ runs, int seg,
                           int hkv, long long dd, Decays decay_L, long long total) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const long long e = i % dd, bg = i / dd;
  const int g = static_cast<int>(bg % hkv);
  const long long b = bg / hkv;
  const long long block = ((b * 2 + seg) * hkv + g) * dd + e;
  const float x = msg[i];
  mine[block] = x;
  msg[i] = decay_L.g[g] * x + runs[block];
}
}  // namespace

void hop(float* msg, float* mine, const float* runs, int seg, std::int64_t B, int hkv, std::int64_t dd,
         const Decays& decay_L, cudaStream_t stream) {
  if (hkv < 1 || hkv > kMaxKvHeads) fail("LASP-1 (cuda): {} kv heads, at most {}", hkv, kMaxKvHeads);
  const long long total = B * hkv * dd;
  if (total == 0) return;
  const int threads = 256;
  hop_kernel<<<static_cast<unsigned>((total + threads - 1) / threads), threads, 0, stream>>>(msg, mine, runs, seg, hkv,
                                                                                             dd, decay_L, total);
  KEEL_CUDA_CHECK(cudaGetLastError());
}

void walk(const float* gathered, float* mine, int C, int rank, std::int64_t B, int hkv, std::int64_t dd,
          const Decays& decay_L, bool reverse, cudaStream_t stream) {
  if (hkv < 1 || hkv > kMaxKvHeads) fail("LASP-2 (cuda): {} kv heads, at most {}", hkv, kMaxKvHeads);
  const long long total = B * hkv * dd;
  if (total == 0) return;
  const int threads = 256;
  walk_kernel<<<static_cast<unsigned>((total + threads - 1) / threads), threads, 0, stream>>>(
      gathered, mine, C, rank, hkv, dd, decay_L, reverse, total);
  KEEL_CUDA_CHECK(cudaGetLastError());
}

}  // namespace keel::parallel::lasp2

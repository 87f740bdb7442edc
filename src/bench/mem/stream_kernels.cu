#include <cmath>

#include "bench/mem/stream_kernels.h"
#include "bench/mem/values.h"

namespace keel::bench {
namespace {

// Vectors of 16 bytes: one LDG.128/STG.128 per access.
template <typename T> struct Vec16;
template <> struct Vec16<float> { using type = float4; static constexpr int lanes = 4; };
template <> struct Vec16<double> { using type = double2; static constexpr int lanes = 2; };

template <typename T>
__device__ __forceinline__ T& lane(typename Vec16<T>::type& v, int i) {
  return reinterpret_cast<T*>(&v)[i];
}

// out-lane = f(a, b, c) for the kernels of values.h.
template <int K, typename T>
__device__ __forceinline__ T apply(T a, T b, T c, T s) {
  if constexpr (K == kKernelCopy) return a;
  else if constexpr (K == kKernelMul) return s * c;
  else if constexpr (K == kKernelAdd) return a + b;
  else if constexpr (K == kKernelTriad) return b + s * c;
  else return a + b + s * c;  // nstream: a += b + s*c
}

template <int K> constexpr bool reads_a() { return K == kKernelCopy || K == kKernelAdd || K == kKernelNstream; }
template <int K> constexpr bool reads_b() { return K == kKernelAdd || K == kKernelTriad || K == kKernelNstream; }
template <int K> constexpr bool reads_c() { return K == kKernelMul || K == kKernelTriad || K == kKernelNstream; }

// Each thread keeps kUnroll independent 16-byte loads per input in flight before it stores, so
// a grid of a few blocks per SM covers HBM latency without a thread per element.
constexpr int kUnroll = 4;

template <int K, typename T>
__global__ void __launch_bounds__(kStreamBlock) elementwise_kernel(T* __restrict__ a, T* __restrict__ b,
                                                                   T* __restrict__ c, T s, std::uint64_t n) {
  using V = typename Vec16<T>::type;
  constexpr int W = Vec16<T>::lanes;
  T* out = K == kKernelMul ? b : (K == kKernelCopy || K == kKernelAdd) ? c : a;
  const std::uint64_t nv = n / W;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const V* av = reinterpret_cast<const V*>(a);
  const V* bv = reinterpret_cast<const V*>(b);
  const V* cv = reinterpret_cast<const V*>(c);
  V* ov = reinterpret_cast<V*>(out);
  for (; i + (kUnroll - 1) * stride < nv; i += kUnroll * stride) {
    V x[kUnroll], y[kUnroll], z[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (reads_a<K>()) x[u] = av[i + u * stride];
      if constexpr (reads_b<K>()) y[u] = bv[i + u * stride];
      if constexpr (reads_c<K>()) z[u] = cv[i + u * stride];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      V r;
#pragma unroll
      for (int l = 0; l < W; ++l)
        lane<T>(r, l) = apply<K, T>(reads_a<K>() ? lane<T>(x[u], l) : T(0), reads_b<K>() ? lane<T>(y[u], l) : T(0),
                                    reads_c<K>() ? lane<T>(z[u], l) : T(0), s);
      ov[i + u * stride] = r;
    }
  }
  for (; i < nv; i += stride) {
    V x, y, z, r;
    if constexpr (reads_a<K>()) x = av[i];
    if constexpr (reads_b<K>()) y = bv[i];
    if constexpr (reads_c<K>()) z = cv[i];
#pragma unroll
    for (int l = 0; l < W; ++l)
      lane<T>(r, l) = apply<K, T>(reads_a<K>() ? lane<T>(x, l) : T(0), reads_b<K>() ? lane<T>(y, l) : T(0),
                                  reads_c<K>() ? lane<T>(z, l) : T(0), s);
    ov[i] = r;
  }
  // The last n % W elements, one per thread of the first block.
  const std::uint64_t t = nv * W + static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) out[t] = apply<K, T>(a[t], b[t], c[t], s);
}

// One-shot: block b owns vectors [b * Block * Unroll, (b + 1) * Block * Unroll), thread t the
// ones at t + u * Block, so each warp's accesses stay contiguous. Streaming variants load and
// store with the evict-first hints (ld.global.cs / st.global.cs): every byte is touched once.
template <typename V, bool Streaming>
__device__ __forceinline__ V load_vec(const V* p) {
  if constexpr (Streaming) return __ldcs(p);
  else return *p;
}
template <typename V, bool Streaming>
__device__ __forceinline__ void store_vec(V* p, V v) {
  if constexpr (Streaming) __stcs(p, v);
  else *p = v;
}

template <int K, typename T, int Block, int Unroll, bool Streaming>
__global__ void __launch_bounds__(Block) oneshot_kernel(T* __restrict__ a, T* __restrict__ b, T* __restrict__ c, T s,
                                                        std::uint64_t n) {
  using V = typename Vec16<T>::type;
  constexpr int W = Vec16<T>::lanes;
  T* out = K == kKernelMul ? b : (K == kKernelCopy || K == kKernelAdd) ? c : a;
  const std::uint64_t nv = n / W;
  const std::uint64_t base = static_cast<std::uint64_t>(blockIdx.x) * Block * Unroll + threadIdx.x;
  const V* av = reinterpret_cast<const V*>(a);
  const V* bv = reinterpret_cast<const V*>(b);
  const V* cv = reinterpret_cast<const V*>(c);
  V* ov = reinterpret_cast<V*>(out);
  V x[Unroll], y[Unroll], z[Unroll];
#pragma unroll
  for (int u = 0; u < Unroll; ++u) {
    const std::uint64_t i = base + static_cast<std::uint64_t>(u) * Block;
    if (i < nv) {
      if constexpr (reads_a<K>()) x[u] = load_vec<V, Streaming>(av + i);
      if constexpr (reads_b<K>()) y[u] = load_vec<V, Streaming>(bv + i);
      if constexpr (reads_c<K>()) z[u] = load_vec<V, Streaming>(cv + i);
    }
  }
#pragma unroll
  for (int u = 0; u < Unroll; ++u) {
    const std::uint64_t i = base + static_cast<std::uint64_t>(u) * Block;
    if (i < nv) {
      V r;
#pragma unroll
      for (int l = 0; l < W; ++l)
        lane<T>(r, l) = apply<K, T>(reads_a<K>() ? lane<T>(x[u], l) : T(0), reads_b<K>() ? lane<T>(y[u], l) : T(0),
                                    reads_c<K>() ? lane<T>(z[u], l) : T(0), s);
      store_vec<V, Streaming>(ov + i, r);
    }
  }
  const std::uint64_t t = nv * W + static_cast<std::uint64_t>(blockIdx.x) * Block + threadIdx.x;
  if (t < n) out[t] = apply<K, T>(a[t], b[t], c[t], s);
}

// BabelStream's dot: per-thread sums in T, a block reduction in T, one partial per block.
template <typename T>
__global__ void __launch_bounds__(kStreamBlock) dot_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                           T* __restrict__ partials, std::uint64_t n) {
  using V = typename Vec16<T>::type;
  constexpr int W = Vec16<T>::lanes;
  __shared__ T sums[kStreamBlock];
  const std::uint64_t nv = n / W;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const V* av = reinterpret_cast<const V*>(a);
  const V* bv = reinterpret_cast<const V*>(b);
  T sum = 0;
  for (; i + (kUnroll - 1) * stride < nv; i += kUnroll * stride) {
    V x[kUnroll], y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      x[u] = av[i + u * stride];
      y[u] = bv[i + u * stride];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int l = 0; l < W; ++l) sum += lane<T>(x[u], l) * lane<T>(y[u], l);
  }
  for (; i < nv; i += stride) {
    V x = av[i], y = bv[i];
#pragma unroll
    for (int l = 0; l < W; ++l) sum += lane<T>(x, l) * lane<T>(y, l);
  }
  const std::uint64_t t = nv * W + static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) sum += a[t] * b[t];
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int off = kStreamBlock / 2; off > 0; off /= 2) {
    if (threadIdx.x < off) sums[threadIdx.x] += sums[threadIdx.x + off];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

template <typename T>
__global__ void fill_kernel(T* a, T* b, T* c, std::uint64_t n, std::uint64_t seed, bool poison_c) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (a) a[i] = static_cast<T>(stream_input(seed, kArrayA, i));
    if (b) b[i] = static_cast<T>(stream_input(seed, kArrayB, i));
    if (c) c[i] = poison_c ? static_cast<T>(NAN) : static_cast<T>(stream_input(seed, kArrayC, i));
  }
}

template <typename T>
__global__ void verify_kernel(int kernel, const T* out, std::uint64_t n, std::uint64_t seed, std::uint64_t runs,
                              double scalar, double eps, StreamVerifyCounters* counters) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long wrong = 0, first = ~0ull;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const StreamExpectation e = stream_expected(kernel, seed, i, runs, scalar, eps);
    const double got = static_cast<double>(out[i]);
    if (!(fabs(got - e.value) <= e.tolerance)) {
      ++wrong;
      if (i < first) first = i;
    }
  }
  if (wrong) {
    atomicAdd(&counters->wrong, wrong);
    atomicMin(&counters->first, first);
  }
}

template <typename T>
void launch_kernel_typed(int kernel, T* a, T* b, T* c, std::uint64_t n, T* partials, int grid, cudaStream_t s) {
  const T scalar = static_cast<T>(kStreamScalar);
  switch (kernel) {
    case kKernelCopy: elementwise_kernel<kKernelCopy, T><<<grid, kStreamBlock, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelMul: elementwise_kernel<kKernelMul, T><<<grid, kStreamBlock, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelAdd: elementwise_kernel<kKernelAdd, T><<<grid, kStreamBlock, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelTriad: elementwise_kernel<kKernelTriad, T><<<grid, kStreamBlock, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelNstream: elementwise_kernel<kKernelNstream, T><<<grid, kStreamBlock, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelDot: dot_kernel<T><<<grid, kStreamBlock, 0, s>>>(a, b, partials, n); break;
  }
}

template <typename T, int Block, int Unroll, bool Streaming>
void launch_oneshot_shape(int kernel, T* a, T* b, T* c, std::uint64_t n, cudaStream_t s) {
  const T scalar = static_cast<T>(kStreamScalar);
  const std::uint64_t nv = n / Vec16<T>::lanes, per_block = static_cast<std::uint64_t>(Block) * Unroll;
  // The scalar tail (n % lanes elements) is handled by the first threads of the grid.
  const std::uint64_t blocks = nv < per_block ? 1 : (nv + per_block - 1) / per_block;
  const int grid = static_cast<int>(blocks);
  switch (kernel) {
    case kKernelCopy: oneshot_kernel<kKernelCopy, T, Block, Unroll, Streaming><<<grid, Block, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelMul: oneshot_kernel<kKernelMul, T, Block, Unroll, Streaming><<<grid, Block, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelAdd: oneshot_kernel<kKernelAdd, T, Block, Unroll, Streaming><<<grid, Block, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelTriad: oneshot_kernel<kKernelTriad, T, Block, Unroll, Streaming><<<grid, Block, 0, s>>>(a, b, c, scalar, n); break;
    case kKernelNstream: oneshot_kernel<kKernelNstream, T, Block, Unroll, Streaming><<<grid, Block, 0, s>>>(a, b, c, scalar, n); break;
  }
}

template <typename T>
void launch_oneshot_typed(int kernel, T* a, T* b, T* c, std::uint64_t n, int variant, cudaStream_t s) {
  switch (variant) {
    case 0: launch_oneshot_shape<T, 256, 4, false>(kernel, a, b, c, n, s); break;
    case 1: launch_oneshot_shape<T, 128, 8, false>(kernel, a, b, c, n, s); break;
    case 2: launch_oneshot_shape<T, 256, 4, true>(kernel, a, b, c, n, s); break;
    default: launch_oneshot_shape<T, 128, 8, true>(kernel, a, b, c, n, s); break;
  }
}

}  // namespace

template <typename T>
const void* kernel_function(int kernel) {
  switch (kernel) {
    case kKernelCopy: return reinterpret_cast<const void*>(elementwise_kernel<kKernelCopy, T>);
    case kKernelMul: return reinterpret_cast<const void*>(elementwise_kernel<kKernelMul, T>);
    case kKernelAdd: return reinterpret_cast<const void*>(elementwise_kernel<kKernelAdd, T>);
    case kKernelTriad: return reinterpret_cast<const void*>(elementwise_kernel<kKernelTriad, T>);
    case kKernelNstream: return reinterpret_cast<const void*>(elementwise_kernel<kKernelNstream, T>);
    default: return reinterpret_cast<const void*>(dot_kernel<T>);
  }
}

int stream_grid(int kernel, bool f64, std::uint64_t n, int sm_count) {
  int per_sm = 0;
  const void* fn = f64 ? kernel_function<double>(kernel) : kernel_function<float>(kernel);
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kStreamBlock, 0) != cudaSuccess || per_sm < 1) {
    cudaGetLastError();
    per_sm = 1;
  }
  const std::uint64_t full = static_cast<std::uint64_t>(sm_count > 0 ? sm_count : 1) * static_cast<std::uint64_t>(per_sm);
  const std::uint64_t lanes = f64 ? 2 : 4;
  const std::uint64_t needed = (n / lanes + kStreamBlock - 1) / kStreamBlock;
  return static_cast<int>(needed < 1 ? 1 : needed < full ? needed : full);
}

int stream_aux_grid(std::uint64_t n, int sm_count) {
  const std::uint64_t full = static_cast<std::uint64_t>(sm_count > 0 ? sm_count : 1) * 8;
  const std::uint64_t needed = (n + kStreamBlock - 1) / kStreamBlock;
  return static_cast<int>(needed < 1 ? 1 : needed < full ? needed : full);
}

void launch_stream_fill(void* a, void* b, void* c, std::uint64_t n, bool f64, std::uint64_t seed, bool poison_c,
                        int grid, cudaStream_t s) {
  if (f64)
    fill_kernel<double><<<grid, kStreamBlock, 0, s>>>(static_cast<double*>(a), static_cast<double*>(b),
                                                      static_cast<double*>(c), n, seed, poison_c);
  else
    fill_kernel<float><<<grid, kStreamBlock, 0, s>>>(static_cast<float*>(a), static_cast<float*>(b),
                                                     static_cast<float*>(c), n, seed, poison_c);
}

void launch_stream_kernel(int kernel, bool f64, void* a, void* b, void* c, std::uint64_t n, void* dot_partials,
                          int grid, cudaStream_t s) {
  if (f64)
    launch_kernel_typed<double>(kernel, static_cast<double*>(a), static_cast<double*>(b), static_cast<double*>(c), n,
                                static_cast<double*>(dot_partials), grid, s);
  else
    launch_kernel_typed<float>(kernel, static_cast<float*>(a), static_cast<float*>(b), static_cast<float*>(c), n,
                               static_cast<float*>(dot_partials), grid, s);
}

void launch_stream_verify(int kernel, bool f64, const void* out, std::uint64_t n, std::uint64_t seed,
                          std::uint64_t runs, StreamVerifyCounters* counters, int grid, cudaStream_t s) {
  if (f64)
    verify_kernel<double><<<grid, kStreamBlock, 0, s>>>(kernel, static_cast<const double*>(out), n, seed, runs,
                                                        static_cast<double>(static_cast<double>(kStreamScalar)),
                                                        0x1p-53, counters);
  else
    verify_kernel<float><<<grid, kStreamBlock, 0, s>>>(kernel, static_cast<const float*>(out), n, seed, runs,
                                                       static_cast<double>(static_cast<float>(kStreamScalar)),
                                                       0x1p-24, counters);
}

const char* stream_oneshot_variant_name(int variant) {
  static const char* const names[kStreamOneshotVariants] = {"one-shot 256x4", "one-shot 128x8", "one-shot 256x4 cs",
                                                             "one-shot 128x8 cs"};
  return variant >= 0 && variant < kStreamOneshotVariants ? names[variant] : "?";
}

void launch_stream_kernel_oneshot(int kernel, bool f64, void* a, void* b, void* c, std::uint64_t n, int variant,
                                  cudaStream_t s) {
  if (f64)
    launch_oneshot_typed<double>(kernel, static_cast<double*>(a), static_cast<double*>(b), static_cast<double*>(c), n,
                                 variant, s);
  else
    launch_oneshot_typed<float>(kernel, static_cast<float*>(a), static_cast<float*>(b), static_cast<float*>(c), n,
                                variant, s);
}

}  // namespace keel::bench

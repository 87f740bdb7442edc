#include "ops/cuda/cast.h"

#include <algorithm>
#include <cstdint>

#include "common/error.h"

namespace keel::ops::cuda {

namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H100/H200 several times over; past that, threads loop (grid-stride).
constexpr std::int64_t kMaxBlocks = 4096;

// 4 and 8 bf16 packed for one 8- or 16-byte store/load.
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};
struct alignas(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

// Each conversion: its element types, the elements per vector step (a 16-byte input load), and
// the scalar and vector bodies. Vector index v covers elements [v * kWidth, (v + 1) * kWidth).
struct F32ToBf16 {
  using In = float;
  using Out = bf16;
  static constexpr int kWidth = 4;
  __device__ static void scalar(const float* in, bf16* out, std::int64_t i) { out[i] = __float2bfloat16(in[i]); }
  __device__ static void vector(const float* in, bf16* out, std::int64_t v) {
    const float4 x = reinterpret_cast<const float4*>(in)[v];
    Bf16x4 y;
    y.lo = __floats2bfloat162_rn(x.x, x.y);
    y.hi = __floats2bfloat162_rn(x.z, x.w);
    reinterpret_cast<Bf16x4*>(out)[v] = y;
  }
};

struct Bf16ToF32 {
  using In = bf16;
  using Out = float;
  static constexpr int kWidth = 8;
  __device__ static void scalar(const bf16* in, float* out, std::int64_t i) { out[i] = __bfloat162float(in[i]); }
  __device__ static void vector(const bf16* in, float* out, std::int64_t v) {
    const Bf16x8 x = reinterpret_cast<const Bf16x8*>(in)[v];
    const float2 a = __bfloat1622float2(x.v[0]), b = __bfloat1622float2(x.v[1]);
    const float2 c = __bfloat1622float2(x.v[2]), d = __bfloat1622float2(x.v[3]);
    float4* o = reinterpret_cast<float4*>(out) + 2 * v;
    o[0] = make_float4(a.x, a.y, b.x, b.y);
    o[1] = make_float4(c.x, c.y, d.x, d.y);
  }
};

struct AddBf16ToF32 {
  using In = bf16;
  using Out = float;
  static constexpr int kWidth = 8;
  __device__ static void scalar(const bf16* in, float* acc, std::int64_t i) { acc[i] += __bfloat162float(in[i]); }
  __device__ static void vector(const bf16* in, float* acc, std::int64_t v) {
    const Bf16x8 x = reinterpret_cast<const Bf16x8*>(in)[v];
    const float2 a = __bfloat1622float2(x.v[0]), b = __bfloat1622float2(x.v[1]);
    const float2 c = __bfloat1622float2(x.v[2]), d = __bfloat1622float2(x.v[3]);
    float4* o = reinterpret_cast<float4*>(acc) + 2 * v;
    float4 lo = o[0], hi = o[1];
    lo.x += a.x, lo.y += a.y, lo.z += b.x, lo.w += b.y;
    hi.x += c.x, hi.y += c.y, hi.z += d.x, hi.w += d.y;
    o[0] = lo;
    o[1] = hi;
  }
};

// Elements [0, head) and [head + nvec * kWidth, n) one at a time; the body in vector steps
// starting at element `head` (where both pointers are vector-aligned).
template <class Op>
__global__ void elementwise_kernel(const typename Op::In* in, typename Op::Out* out, std::int64_t n, std::int64_t head,
                                   std::int64_t nvec) {
  const std::int64_t tid = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t v = tid; v < nvec; v += step) Op::vector(in + head, out + head, v);
  const std::int64_t body_end = head + nvec * Op::kWidth;
  const std::int64_t loose = head + (n - body_end);
  for (std::int64_t i = tid; i < loose; i += step) Op::scalar(in, out, i < head ? i : body_end + (i - head));
}

// Splits n elements into a scalar head (until `in` reaches its vector alignment), a vector body
// and a scalar tail. When `out` is not aligned at the same element, everything goes scalar:
// rare (a caller offsetting the two buffers differently) and still correct.
template <class Op>
void launch_elementwise(const typename Op::In* in, typename Op::Out* out, std::int64_t n, cudaStream_t stream) {
  if (n < 0) fail("cast: element count must be >= 0, got {}", n);
  if (n == 0) return;
  if (in == nullptr || out == nullptr) fail("cast: null pointer for {} elements", n);
  constexpr std::uintptr_t in_align = Op::kWidth * sizeof(typename Op::In);
  constexpr std::uintptr_t out_align = std::min<std::uintptr_t>(16, Op::kWidth * sizeof(typename Op::Out));
  const auto in_addr = reinterpret_cast<std::uintptr_t>(in);
  std::int64_t head = static_cast<std::int64_t>(((in_align - in_addr % in_align) % in_align) / sizeof(typename Op::In));
  std::int64_t nvec = 0;
  const auto out_addr = reinterpret_cast<std::uintptr_t>(out + std::min(head, n));
  if (head < n && out_addr % out_align == 0) nvec = (n - head) / Op::kWidth;
  else head = n;  // all scalar
  const std::int64_t work = std::max(nvec, n - nvec * Op::kWidth);
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(grid_for(work, kThreads), kMaxBlocks));
  elementwise_kernel<Op><<<blocks, kThreads, 0, stream>>>(in, out, n, head, nvec);
  KEEL_CUDA_CHECK_LAUNCH();
}

__device__ inline float load_float(const float* p) { return *p; }
__device__ inline float load_float(const bf16* p) { return __bfloat162float(*p); }
__device__ inline void store_float(float* p, float v) { *p = v; }
__device__ inline void store_float(bf16* p, float v) { *p = __float2bfloat16(v); }

template <typename T>
__global__ void scale_matrix_kernel(T* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t total,
                                    std::int64_t stride, float beta) {
  const std::int64_t tid = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = tid; i < total; i += step) {
    const std::int64_t col = i % cols, row_of_all = i / cols;
    const std::int64_t row = row_of_all % rows, b = row_of_all / rows;
    T* p = c + b * stride + row * ld + col;
    store_float(p, beta == 0.f ? 0.f : beta * load_float(p));
  }
}

template <typename T>
void launch_scale_matrix(T* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, int batch, std::int64_t stride,
                         float beta, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || batch < 0 || ld < cols || stride < 0)
    fail("scale_matrix: bad extents rows={} cols={} ld={} batch={} stride={}", rows, cols, ld, batch, stride);
  const std::int64_t total = rows * cols * batch;
  if (total == 0) return;
  if (c == nullptr) fail("scale_matrix: null pointer for a {}x{} matrix", rows, cols);
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(grid_for(total, kThreads), kMaxBlocks));
  scale_matrix_kernel<T><<<blocks, kThreads, 0, stream>>>(c, rows, cols, ld, total, stride, beta);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void f32_to_bf16(const float* in, bf16* out, std::int64_t n, cudaStream_t stream) {
  launch_elementwise<F32ToBf16>(in, out, n, stream);
}

void bf16_to_f32(const bf16* in, float* out, std::int64_t n, cudaStream_t stream) {
  launch_elementwise<Bf16ToF32>(in, out, n, stream);
}

void add_bf16_to_f32(const bf16* in, float* acc, std::int64_t n, cudaStream_t stream) {
  launch_elementwise<AddBf16ToF32>(in, acc, n, stream);
}

void scale_matrix_f32(float* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, int batch, std::int64_t stride,
                      float beta, cudaStream_t stream) {
  launch_scale_matrix(c, rows, cols, ld, batch, stride, beta, stream);
}

void scale_matrix_bf16(bf16* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, int batch, std::int64_t stride,
                       float beta, cudaStream_t stream) {
  launch_scale_matrix(c, rows, cols, ld, batch, stride, beta, stream);
}

}  // namespace keel::ops::cuda

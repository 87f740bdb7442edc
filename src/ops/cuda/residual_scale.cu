#include "ops/cuda/residual_scale.h"

#include <algorithm>
#include <cstdint>

#include "common/error.h"

namespace keel::ops::cuda::residual_scale {

namespace {

constexpr int kThreads = 256;
constexpr int kColThreads = 128;        // columns per block of the parameter-gradient kernel
constexpr int kColTargetBlocks = 528;   // ~4 blocks per SM on an H100

__device__ inline float to_f(float v) { return v; }
__device__ inline float to_f(bf16 v) { return __bfloat162float(v); }

// Forward passes: one block per row, threads over the columns, so the column index needs no
// per-element 64-bit division (which, not memory, bounded the flat element loops these replace).
__global__ void forward_kernel(const float* __restrict__ x, const float* __restrict__ b, const float* __restrict__ s,
                               float* y, std::int64_t rows, std::int64_t dim) {
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::int64_t base = row * dim;
    for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) y[base + j] = (x[base + j] + b[j]) * s[j];
  }
}

template <typename H>
__global__ void merge_forward_kernel(const float* r, const H* h, const float* __restrict__ b_r,
                                     const float* __restrict__ s_r, const float* __restrict__ b_h,
                                     const float* __restrict__ s_h, float* out, std::int64_t rows, std::int64_t dim) {
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const std::int64_t base = row * dim;
    for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const std::int64_t i = base + j;
      out[i] = (r[i] + b_r[j]) * s_r[j] + (to_f(h[i]) + b_h[j]) * s_h[j];
    }
  }
}

// Backward passes: thread = column j, blockIdx.y = a chunk of rows. One pass reads dy (and the
// saved inputs the scale gradients need) once and writes the stream gradients as it goes, so
// dy is not re-read per output: for a merge, dr = dy s_r and dh = dy s_h, with
//   db_r[j] += s_r[j] sum dy,  ds_r[j] += sum dy (r + b_r),  the same for h.
// A null ds skips that stream's sum (and the read of its input); a null dr or dh skips its
// store. Chunk partials go through atomicAdd (plain adds when one chunk covers all
// rows). Each element of dy is read before the same thread writes the gradient that may alias it.
struct StreamGrad {
  const float* b = nullptr;  // the stream's bias and scale
  const float* s = nullptr;
  float* db = nullptr;  // accumulated; null to skip
  float* ds = nullptr;
};

__device__ inline void add_param_grad(float* p, float v, bool one) {
  if (one)
    *p += v;
  else
    atomicAdd(p, v);
}

// kV consecutive columns of one row: 4 in one 16-byte (fp32) or 8-byte (bf16) access, or 1.
template <int kV>
__device__ inline void load_v(const float* p, float* v) {
  if constexpr (kV == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
    v[0] = *p;
  }
}
template <int kV>
__device__ inline void load_v(const bf16* p, float* v) {
  if constexpr (kV == 4) load_bf16<4>(p, v);
  else v[0] = __bfloat162float(*p);
}
template <int kV>
__device__ inline void store_v(float* p, const float* v) {
  if constexpr (kV == 4) *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  else *p = v[0];
}
template <int kV>
__device__ inline void store_v(bf16* p, const float* v) {
  if constexpr (kV == 4) store_bf16<4>(p, v);
  else *p = __float2bfloat16(v[0]);
}

// kV = 4: each thread takes 4 consecutive columns (dim % 4 == 0, every row pointer aligned for
// the vector accesses), so a warp moves 4x the bytes of a row per access.
template <int kV, typename X, typename D>
__global__ void column_backward_kernel(const float* r, const X* h, StreamGrad gr, StreamGrad gh, const float* dy,
                                       float* dr, D* dh, std::int64_t rows, std::int64_t dim, std::int64_t chunk) {
  const std::int64_t j0 = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kV;
  if (j0 >= dim) return;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  const bool merge = gh.s != nullptr;  // a merge has an h stream; forward()'s backward only r
  const bool sum_r = gr.ds, sum_h = merge && gh.ds;
  float br[kV], sr[kV], bh[kV], sh[kV], g_sum[kV], gs_r[kV], gs_h[kV];
#pragma unroll
  for (int c = 0; c < kV; ++c) {
    br[c] = gr.b[j0 + c], sr[c] = gr.s[j0 + c];
    bh[c] = merge ? gh.b[j0 + c] : 0.f, sh[c] = merge ? gh.s[j0 + c] : 0.f;
    g_sum[c] = gs_r[c] = gs_h[c] = 0.f;
  }
  constexpr int kUnroll = kV == 1 ? 4 : 2;  // rows in flight per thread
#pragma unroll kUnroll
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t k = i * dim + j0;
    float g[kV], v[kV];
    load_v<kV>(dy + k, g);
#pragma unroll
    for (int c = 0; c < kV; ++c) g_sum[c] += g[c];
    if (sum_r) {
      load_v<kV>(r + k, v);
#pragma unroll
      for (int c = 0; c < kV; ++c) gs_r[c] += g[c] * (v[c] + br[c]);
    }
    if (sum_h) {
      load_v<kV>(h + k, v);
#pragma unroll
      for (int c = 0; c < kV; ++c) gs_h[c] += g[c] * (v[c] + bh[c]);
    }
    if (dh) {
#pragma unroll
      for (int c = 0; c < kV; ++c) v[c] = g[c] * sh[c];
      store_v<kV>(dh + k, v);
    }
    if (dr) {
#pragma unroll
      for (int c = 0; c < kV; ++c) v[c] = g[c] * sr[c];
      store_v<kV>(dr + k, v);
    }
  }
  const bool one = gridDim.y == 1;
#pragma unroll
  for (int c = 0; c < kV; ++c) {
    const std::int64_t j = j0 + c;
    if (gr.db) add_param_grad(gr.db + j, g_sum[c] * sr[c], one);
    if (gr.ds) add_param_grad(gr.ds + j, gs_r[c], one);
    if (merge && gh.db) add_param_grad(gh.db + j, g_sum[c] * sh[c], one);
    if (sum_h) add_param_grad(gh.ds + j, gs_h[c], one);
  }
}

void check(std::int64_t rows, std::int64_t dim, const char* what) {
  if (rows < 0 || dim <= 0) fail("residual_scale {}: need rows >= 0 and dim > 0, got rows {}, dim {}", what, rows, dim);
}

unsigned row_grid(std::int64_t rows) { return static_cast<unsigned>(std::min<std::int64_t>(rows, 1 << 20)); }

// Four times the usual block count: each thread walks its rows one step at a time, so it takes
// many threads in flight to keep the loads coming.
template <typename X, typename D>
void launch_column_backward(const float* r, const X* h, const StreamGrad& gr, const StreamGrad& gh, const float* dy,
                            float* dr, D* dh, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  // 4 columns per thread for a merge with a bf16 branch where every row start allows the vector
  // accesses: on an H200 at [8192, 2048] 112 -> 92 us; the all-fp32 passes went 70 -> 80 us that
  // way (fewer rows in flight per thread), so they keep one column per thread.
  if constexpr (sizeof(X) == 2) {
    if (dim % 4 == 0 && aligned_to(dy, 16) && aligned_to(r, 16) && aligned_to(dr, 16) && aligned_to(h, 8) &&
        aligned_to(dh, 4 * sizeof(D))) {
      const ColumnSplit split = column_split(rows, dim / 4, kColThreads, 4 * kColTargetBlocks);
      column_backward_kernel<4, X, D><<<split.grid, kColThreads, 0, stream>>>(r, h, gr, gh, dy, dr, dh, rows, dim,
                                                                             split.chunk);
      KEEL_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  const ColumnSplit split = column_split(rows, dim, kColThreads, 4 * kColTargetBlocks);
  column_backward_kernel<1, X, D><<<split.grid, kColThreads, 0, stream>>>(r, h, gr, gh, dy, dr, dh, rows, dim,
                                                                         split.chunk);
  KEEL_CUDA_CHECK_LAUNCH();
}

template <typename H>
void merge_forward_impl(const float* r, const H* h, const float* b_r, const float* s_r, const float* b_h,
                        const float* s_h, float* out, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  check(rows, dim, "merge_forward");
  if (rows == 0) return;
  merge_forward_kernel<H><<<row_grid(rows), kThreads, 0, stream>>>(r, h, b_r, s_r, b_h, s_h, out, rows, dim);
  KEEL_CUDA_CHECK_LAUNCH();
}

template <typename H>
void merge_backward_impl(const float* r, const H* h, const float* b_r, const float* s_r, const float* b_h,
                         const float* s_h, const float* dout, float* dr, H* dh, float* db_r, float* ds_r, float* db_h,
                         float* ds_h, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  check(rows, dim, "merge_backward");
  if (rows == 0) return;
  if (dh && static_cast<const void*>(dh) == static_cast<const void*>(dout))
    fail("residual_scale merge_backward: dh must not alias dout");
  if (!dr && !dh && !db_r && !ds_r && !db_h && !ds_h) return;
  launch_column_backward<H, H>(r, h, StreamGrad{b_r, s_r, db_r, ds_r}, StreamGrad{b_h, s_h, db_h, ds_h}, dout, dr, dh,
                               rows, dim, stream);
}

}  // namespace

void forward(const float* x, const float* b, const float* s, float* y, std::int64_t rows, std::int64_t dim,
             cudaStream_t stream) {
  check(rows, dim, "forward");
  if (rows == 0) return;
  forward_kernel<<<row_grid(rows), kThreads, 0, stream>>>(x, b, s, y, rows, dim);
  KEEL_CUDA_CHECK_LAUNCH();
}

void backward(const float* x, const float* b, const float* s, const float* dy, float* dx, float* db, float* ds,
              std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  check(rows, dim, "backward");
  if (rows == 0 || (!dx && !db && !ds)) return;
  launch_column_backward<float, float>(x, static_cast<const float*>(nullptr), StreamGrad{b, s, db, ds}, StreamGrad{},
                                       dy, dx, static_cast<float*>(nullptr), rows, dim, stream);
}

void merge_forward(const float* r, const bf16* h, const float* b_r, const float* s_r, const float* b_h,
                   const float* s_h, float* out, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  merge_forward_impl<bf16>(r, h, b_r, s_r, b_h, s_h, out, rows, dim, stream);
}
void merge_forward(const float* r, const float* h, const float* b_r, const float* s_r, const float* b_h,
                   const float* s_h, float* out, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  merge_forward_impl<float>(r, h, b_r, s_r, b_h, s_h, out, rows, dim, stream);
}

void merge_backward(const float* r, const bf16* h, const float* b_r, const float* s_r, const float* b_h,
                    const float* s_h, const float* dout, float* dr, bf16* dh, float* db_r, float* ds_r, float* db_h,
                    float* ds_h, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  merge_backward_impl<bf16>(r, h, b_r, s_r, b_h, s_h, dout, dr, dh, db_r, ds_r, db_h, ds_h, rows, dim, stream);
}
void merge_backward(const float* r, const float* h, const float* b_r, const float* s_r, const float* b_h,
                    const float* s_h, const float* dout, float* dr, float* dh, float* db_r, float* ds_r, float* db_h,
                    float* ds_h, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  merge_backward_impl<float>(r, h, b_r, s_r, b_h, s_h, dout, dr, dh, db_r, ds_r, db_h, ds_h, rows, dim, stream);
}

}  // namespace keel::ops::cuda::residual_scale

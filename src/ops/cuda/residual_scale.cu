#include "ops/cuda/residual_scale.h"

#include <algorithm>

#include "common/error.h"

namespace keel::ops::cuda::residual_scale {

namespace {

constexpr int kThreads = 256;
constexpr int kColThreads = 128;        // columns per block of the parameter-gradient kernel
constexpr int kColTargetBlocks = 528;   // ~4 blocks per SM on an H100

__device__ inline float to_f(float v) { return v; }
__device__ inline float to_f(bf16 v) { return __bfloat162float(v); }
__device__ inline void store(float* p, float v) { *p = v; }
__device__ inline void store(bf16* p, float v) { *p = __float2bfloat16(v); }

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

template <typename X, typename D>
__global__ void column_backward_kernel(const float* r, const X* h, StreamGrad gr, StreamGrad gh, const float* dy,
                                       float* dr, D* dh, std::int64_t rows, std::int64_t dim, std::int64_t chunk) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  const bool merge = gh.s != nullptr;  // a merge has an h stream; forward()'s backward only r
  const float br = gr.b[j], sr = gr.s[j];
  const float bh = merge ? gh.b[j] : 0.f, sh = merge ? gh.s[j] : 0.f;
  const bool sum_r = gr.ds, sum_h = merge && gh.ds;
  float g_sum = 0.f, gs_r = 0.f, gs_h = 0.f;
#pragma unroll 4
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t k = i * dim + j;
    const float g = dy[k];
    g_sum += g;
    if (sum_r) gs_r += g * (r[k] + br);
    if (sum_h) gs_h += g * (to_f(h[k]) + bh);
    if (dh) store(dh + k, g * sh);
    if (dr) dr[k] = g * sr;
  }
  const bool one = gridDim.y == 1;
  if (gr.db) add_param_grad(gr.db + j, g_sum * sr, one);
  if (gr.ds) add_param_grad(gr.ds + j, gs_r, one);
  if (merge && gh.db) add_param_grad(gh.db + j, g_sum * sh, one);
  if (sum_h) add_param_grad(gh.ds + j, gs_h, one);
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
  const ColumnSplit split = column_split(rows, dim, kColThreads, 4 * kColTargetBlocks);
  column_backward_kernel<X, D><<<split.grid, kColThreads, 0, stream>>>(r, h, gr, gh, dy, dr, dh, rows, dim,
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

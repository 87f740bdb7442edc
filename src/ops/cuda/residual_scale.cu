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

__global__ void forward_kernel(const float* __restrict__ x, const float* __restrict__ b, const float* __restrict__ s,
                               float* y, std::int64_t n, std::int64_t dim) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t j = i % dim;
    y[i] = (x[i] + b[j]) * s[j];
  }
}

template <typename H>
__global__ void merge_forward_kernel(const float* r, const H* h, const float* __restrict__ b_r,
                                     const float* __restrict__ s_r, const float* __restrict__ b_h,
                                     const float* __restrict__ s_h, float* out, std::int64_t n, std::int64_t dim) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t j = i % dim;
    out[i] = (r[i] + b_r[j]) * s_r[j] + (to_f(h[i]) + b_h[j]) * s_h[j];
  }
}

// g[i] = dy[i] * s[j] for one stream.
template <typename D>
__global__ void scale_grad_kernel(const float* dy, const float* __restrict__ s, D* dx, std::int64_t n,
                                  std::int64_t dim) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    store(dx + i, dy[i] * s[i % dim]);
}

// Thread = column j, blockIdx.y = chunk of rows: db[j] += s[j] sum dy, ds[j] += sum dy (x + b).
template <typename X>
__global__ void param_grad_kernel(const X* x, const float* __restrict__ b, const float* __restrict__ s,
                                  const float* dy, float* db, float* ds, std::int64_t rows, std::int64_t dim,
                                  std::int64_t chunk) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  const float bj = b[j];
  float gb = 0.f, gs = 0.f;
  for (std::int64_t i = begin; i < end; ++i) {
    const float g = dy[i * dim + j];
    gb += g;
    gs += g * (to_f(x[i * dim + j]) + bj);
  }
  const bool one = gridDim.y == 1;
  if (db) {
    if (one)
      db[j] += gb * s[j];
    else
      atomicAdd(db + j, gb * s[j]);
  }
  if (ds) {
    if (one)
      ds[j] += gs;
    else
      atomicAdd(ds + j, gs);
  }
}

void check(std::int64_t rows, std::int64_t dim, const char* what) {
  if (rows < 0 || dim <= 0) fail("residual_scale {}: need rows >= 0 and dim > 0, got rows {}, dim {}", what, rows, dim);
}

template <typename X>
void launch_param_grads(const X* x, const float* b, const float* s, const float* dy, float* db, float* ds,
                        std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  if (!db && !ds) return;
  const ColumnSplit split = column_split(rows, dim, kColThreads, kColTargetBlocks);
  param_grad_kernel<X><<<split.grid, kColThreads, 0, stream>>>(x, b, s, dy, db, ds, rows, dim, split.chunk);
  KEEL_CUDA_CHECK_LAUNCH();
}

template <typename H>
void merge_forward_impl(const float* r, const H* h, const float* b_r, const float* s_r, const float* b_h,
                        const float* s_h, float* out, std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  check(rows, dim, "merge_forward");
  if (rows == 0) return;
  const std::int64_t n = rows * dim;
  merge_forward_kernel<H><<<elementwise_grid(n, kThreads), kThreads, 0, stream>>>(r, h, b_r, s_r, b_h, s_h, out, n, dim);
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
  // Everything that reads dout runs before dr (which may alias it) is written.
  launch_param_grads<H>(h, b_h, s_h, dout, db_h, ds_h, rows, dim, stream);
  launch_param_grads<float>(r, b_r, s_r, dout, db_r, ds_r, rows, dim, stream);
  const std::int64_t n = rows * dim;
  if (dh) {
    scale_grad_kernel<H><<<elementwise_grid(n, kThreads), kThreads, 0, stream>>>(dout, s_h, dh, n, dim);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  if (dr) {
    scale_grad_kernel<float><<<elementwise_grid(n, kThreads), kThreads, 0, stream>>>(dout, s_r, dr, n, dim);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void forward(const float* x, const float* b, const float* s, float* y, std::int64_t rows, std::int64_t dim,
             cudaStream_t stream) {
  check(rows, dim, "forward");
  if (rows == 0) return;
  const std::int64_t n = rows * dim;
  forward_kernel<<<elementwise_grid(n, kThreads), kThreads, 0, stream>>>(x, b, s, y, n, dim);
  KEEL_CUDA_CHECK_LAUNCH();
}

void backward(const float* x, const float* b, const float* s, const float* dy, float* dx, float* db, float* ds,
              std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  check(rows, dim, "backward");
  if (rows == 0) return;
  launch_param_grads<float>(x, b, s, dy, db, ds, rows, dim, stream);  // before dx: dx may alias dy
  if (dx) {
    const std::int64_t n = rows * dim;
    scale_grad_kernel<float><<<elementwise_grid(n, kThreads), kThreads, 0, stream>>>(dy, s, dx, n, dim);
    KEEL_CUDA_CHECK_LAUNCH();
  }
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

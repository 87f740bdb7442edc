#include "ops/cuda/zaya_router.h"

#include <algorithm>

#include "common/error.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/rmsnorm.h"
#include "ops/cuda/router.h"

namespace keel::ops::cuda::zaya_router {

namespace {

constexpr int kThreads = 256;
constexpr int kColThreads = 128;
constexpr int kTargetBlocks = 528;  // ~4 blocks per SM on an H100
constexpr std::size_t kAlign = 256;

std::size_t round_up(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

__device__ inline float gelu(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
__device__ inline float gelu_grad(float x) {
  return 0.5f * (1.f + erff(x * 0.70710678118654752f)) + x * expf(-0.5f * x * x) * 0.39894228040143268f;
}

__device__ inline void add_partial(float* p, float v, bool one) {
  if (one)
    *p += v;
  else
    atomicAdd(p, v);
}

// state = a0 + b_down + gamma * prev (in place on a0).
__global__ void eda_kernel(float* state, const float* __restrict__ b_down, const float* __restrict__ gamma,
                           const float* __restrict__ prev, std::int64_t n, std::int64_t dim) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t j = i % dim;
    float v = state[i] + b_down[j];
    if (prev) v += gamma[j] * prev[i];
    state[i] = v;
  }
}

// z += b (in place, fp32), h = bf16(GELU(z)).
__global__ void bias_gelu_kernel(float* z, const float* __restrict__ b, bf16* __restrict__ h, std::int64_t n,
                                 std::int64_t dim) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = z[i] + b[i % dim];
    z[i] = v;
    h[i] = __float2bfloat16(gelu(v));
  }
}

// Thread = column, blockIdx.y = row chunk: g = dh * GELU'(z) written back over dh (bf16, it
// feeds the next dgrad/wgrad GEMMs), db += column sums of the fp32 g.
__global__ void gelu_backward_kernel(bf16* dh, const float* __restrict__ z, float* db, std::int64_t rows,
                                     std::int64_t dim, std::int64_t chunk) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  float acc = 0.f;
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t e = i * dim + j;
    const float g = __bfloat162float(dh[e]) * gelu_grad(z[e]);
    dh[e] = __float2bfloat16(g);
    acc += g;
  }
  if (db) add_partial(db + j, acc, gridDim.y == 1);
}

// From da (fp32, dL/d state): da_b = bf16(da) for the W_down GEMMs, db_down += sum da,
// dgamma += sum da * prev, dprev = da * gamma (0 without prev). Thread = column.
__global__ void eda_backward_kernel(const float* __restrict__ da, const float* __restrict__ prev,
                                    const float* __restrict__ gamma, bf16* __restrict__ da_b, float* db_down,
                                    float* dgamma, float* __restrict__ dprev, std::int64_t rows, std::int64_t dim,
                                    std::int64_t chunk) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  const float gj = prev ? gamma[j] : 0.f;
  float sb = 0.f, sg = 0.f;
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t e = i * dim + j;
    const float v = da[e];
    da_b[e] = __float2bfloat16(v);
    sb += v;
    if (prev) sg += v * prev[e];
    if (dprev) dprev[e] = v * gj;
  }
  const bool one = gridDim.y == 1;
  if (db_down) add_partial(db_down + j, sb, one);
  if (dgamma && prev) add_partial(dgamma + j, sg, one);
}

// One warp per token: the skip rows' output (0) and gradients (0).
__global__ void skip_forward_kernel(const bf16* __restrict__ x, const std::int32_t* __restrict__ idx,
                                    const float* __restrict__ gates, int skip_class, float* __restrict__ y,
                                    std::int64_t tokens, std::int64_t hidden) {
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (n >= tokens || idx[n] != skip_class) return;
  for (std::int64_t j = threadIdx.x % 32; j < hidden; j += 32) y[n * hidden + j] = 0.f;
}

template <typename DX>
__global__ void skip_backward_kernel(const bf16* __restrict__ x, const std::int32_t* __restrict__ idx,
                                     const float* __restrict__ gates, int skip_class, const float* __restrict__ dy,
                                     DX* __restrict__ dx, float* __restrict__ dgates, std::int64_t tokens,
                                     std::int64_t hidden) {
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (n >= tokens || idx[n] != skip_class) return;
  const int lane = threadIdx.x % 32;
  if (dx)
    for (std::int64_t j = lane; j < hidden; j += 32) dx[n * hidden + j] = DX(0.f);
  if (dgates && lane == 0) dgates[n] = 0.f;
}

void check_dims(const Dims& d) {
  if (d.tokens < 0 || d.hidden <= 0 || d.dim <= 0 || d.classes < 1)
    fail("cuda zaya_router: need tokens >= 0 and positive hidden, dim, classes (got {}, {}, {}, {})", d.tokens,
         d.hidden, d.dim, d.classes);
}

struct Scratch {
  float* dlogits;   // [N, E]
  bf16* dlogits_b;  // [N, E]
  bf16* a;          // [N, D]
  bf16* b;          // [N, D]
  float* da;        // [N, D]
};

Scratch carve_scratch(const Dims& d, void* p) {
  char* c = static_cast<char*>(p);
  const std::size_t ne = static_cast<std::size_t>(d.tokens) * d.classes, nd = static_cast<std::size_t>(d.tokens * d.dim);
  Scratch s;
  s.dlogits = reinterpret_cast<float*>(c), c += round_up(ne * 4);
  s.dlogits_b = reinterpret_cast<bf16*>(c), c += round_up(ne * 2);
  s.a = reinterpret_cast<bf16*>(c), c += round_up(nd * 2);
  s.b = reinterpret_cast<bf16*>(c), c += round_up(nd * 2);
  s.da = reinterpret_cast<float*>(c);
  return s;
}

}  // namespace

std::size_t saved_bytes(const Dims& d) {
  const std::size_t n = static_cast<std::size_t>(d.tokens), nd = n * d.dim, ne = n * d.classes;
  return round_up(nd * 4) + round_up(n * 4) + round_up(nd * 2) + 2 * (round_up(nd * 4) + round_up(nd * 2)) +
         2 * round_up(ne * 4) + 2 * round_up(n * 4) + round_up(n * 4) + round_up(std::size_t(d.classes) * 4) +
         round_up(std::size_t(router::loss_floats(d.classes)) * 4);
}

Saved carve_saved(const Dims& d, void* buffer) {
  char* c = static_cast<char*>(buffer);
  const std::size_t n = static_cast<std::size_t>(d.tokens), nd = n * d.dim, ne = n * d.classes;
  auto take = [&c](std::size_t bytes) {
    char* p = c;
    c += round_up(bytes);
    return p;
  };
  Saved s;
  s.state = reinterpret_cast<float*>(take(nd * 4));
  s.rstd = reinterpret_cast<float*>(take(n * 4));
  s.u = reinterpret_cast<bf16*>(take(nd * 2));
  s.z1 = reinterpret_cast<float*>(take(nd * 4));
  s.h1 = reinterpret_cast<bf16*>(take(nd * 2));
  s.z2 = reinterpret_cast<float*>(take(nd * 4));
  s.h2 = reinterpret_cast<bf16*>(take(nd * 2));
  s.logits = reinterpret_cast<float*>(take(ne * 4));
  s.probs = reinterpret_cast<float*>(take(ne * 4));
  s.lse = reinterpret_cast<float*>(take(n * 4));
  s.gates = reinterpret_cast<float*>(take(n * 4));
  s.idx = reinterpret_cast<std::int32_t*>(take(n * 4));
  s.counts = reinterpret_cast<std::int32_t*>(take(std::size_t(d.classes) * 4));
  s.losses = reinterpret_cast<float*>(take(std::size_t(router::loss_floats(d.classes)) * 4));
  return s;
}

void forward(GemmRunner& gemm, const Dims& d, const bf16* x, const float* prev_state, const Weights& w,
             const float* bias, const Saved& s, cudaStream_t stream) {
  check_dims(d);
  if (prev_state && !w.gamma) fail("cuda zaya_router: EDA (prev_state given) needs gamma");
  const std::int64_t N = d.tokens, D = d.dim, nd = N * D;
  router::Options o;
  o.top_k = 1;
  o.renormalize = false;
  o.forced_classes = d.forced_classes;
  if (N == 0) {
    router::forward(nullptr, bias, 0, d.classes, o, nullptr, nullptr, nullptr, nullptr, s.counts, s.losses, stream);
    return;
  }
  linear::forward_f32(gemm, x, w.w_down, s.state, N, d.hidden, D, stream);
  eda_kernel<<<elementwise_grid(nd, kThreads), kThreads, 0, stream>>>(s.state, w.b_down, w.gamma, prev_state, nd, D);
  KEEL_CUDA_CHECK_LAUNCH();
  rmsnorm::forward(s.state, w.w_norm, d.eps, s.u, s.rstd, N, D, stream);
  linear::forward_f32(gemm, s.u, w.w1, s.z1, N, D, D, stream);
  bias_gelu_kernel<<<elementwise_grid(nd, kThreads), kThreads, 0, stream>>>(s.z1, w.b1, s.h1, nd, D);
  KEEL_CUDA_CHECK_LAUNCH();
  linear::forward_f32(gemm, s.h1, w.w2, s.z2, N, D, D, stream);
  bias_gelu_kernel<<<elementwise_grid(nd, kThreads), kThreads, 0, stream>>>(s.z2, w.b2, s.h2, nd, D);
  KEEL_CUDA_CHECK_LAUNCH();
  linear::forward_f32(gemm, s.h2, w.w3, s.logits, N, D, d.classes, stream);
  router::forward(s.logits, bias, N, d.classes, o, s.probs, s.lse, s.idx, s.gates, s.counts, s.losses, stream);
}

std::size_t backward_scratch_bytes(const Dims& d) {
  const std::size_t ne = static_cast<std::size_t>(d.tokens) * d.classes, nd = static_cast<std::size_t>(d.tokens * d.dim);
  return round_up(ne * 4) + round_up(ne * 2) + 2 * round_up(nd * 2) + round_up(nd * 4);
}

namespace {

// dx (bf16, written) or dx_sum (fp32, added into): the router's input gradient.
void backward_impl(GemmRunner& gemm, const Dims& d, const bf16* x, const float* prev_state, const Weights& w,
                   const Saved& s, const float* dgates, const float* dstate_next, bf16* dx, float* dx_sum,
                   float* dprev_state, const Grads& g, void* scratch, cudaStream_t stream, float d_aux) {
  check_dims(d);
  const std::int64_t N = d.tokens, D = d.dim, E = d.classes;
  if (N == 0) return;
  if (!dgates) fail("cuda zaya_router backward: dgates must not be null");
  if (prev_state && !w.gamma) fail("cuda zaya_router: EDA (prev_state given) needs gamma");
  const Scratch k = carve_scratch(d, scratch);
  router::Options o;
  o.top_k = 1;
  o.renormalize = false;
  router::backward(s.probs, s.lse, s.idx, s.gates, s.counts, N, d.classes, o, dgates, d_aux, 0.f, k.dlogits, stream);
  f32_to_bf16(k.dlogits, k.dlogits_b, N * E, stream);
  const ColumnSplit cs = column_split(N, D, kColThreads, kTargetBlocks);
  // W3 -> GELU' -> W2 -> GELU' -> W1, ping-ponging between the two bf16 buffers a and b.
  linear::backward(gemm, s.h2, w.w3, k.dlogits_b, k.a, g.w3, N, D, E, stream);  // a = dh2
  gelu_backward_kernel<<<cs.grid, kColThreads, 0, stream>>>(k.a, s.z2, g.b2, N, D, cs.chunk);  // a = dz2
  KEEL_CUDA_CHECK_LAUNCH();
  linear::backward(gemm, s.h1, w.w2, k.a, k.b, g.w2, N, D, D, stream);  // b = dh1
  gelu_backward_kernel<<<cs.grid, kColThreads, 0, stream>>>(k.b, s.z1, g.b1, N, D, cs.chunk);  // b = dz1
  KEEL_CUDA_CHECK_LAUNCH();
  linear::backward(gemm, s.u, w.w1, k.b, k.a, g.w1, N, D, D, stream);  // a = du
  // da = dstate_next + RMSNorm backward (which accumulates into its dx).
  if (dstate_next)
    KEEL_CUDA_CHECK(cudaMemcpyAsync(k.da, dstate_next, sizeof(float) * N * D, cudaMemcpyDeviceToDevice, stream));
  else
    KEEL_CUDA_CHECK(cudaMemsetAsync(k.da, 0, sizeof(float) * N * D, stream));
  rmsnorm::backward(s.state, w.w_norm, s.rstd, k.a, k.da, g.w_norm, N, D, stream);
  eda_backward_kernel<<<cs.grid, kColThreads, 0, stream>>>(k.da, prev_state, w.gamma, k.b, g.b_down, g.gamma,
                                                           dprev_state, N, D, cs.chunk);  // b = bf16(da)
  KEEL_CUDA_CHECK_LAUNCH();
  linear::backward(gemm, x, w.w_down, k.b, dx, g.w_down, N, d.hidden, D, stream);
  if (dx_sum) {  // dx_sum [N, H] += b [N, D] W_down [D, H]
    GemmDesc gd;
    gd.m = N, gd.n = d.hidden, gd.k = D, gd.c_type = GemmOut::kFp32, gd.beta = 1.f;
    gemm.run(gd, k.b, w.w_down, dx_sum, stream);
  }
}

}  // namespace

void backward(GemmRunner& gemm, const Dims& d, const bf16* x, const float* prev_state, const Weights& w,
              const Saved& s, const float* dgates, const float* dstate_next, bf16* dx, float* dprev_state,
              const Grads& g, void* scratch, cudaStream_t stream, float d_aux) {
  backward_impl(gemm, d, x, prev_state, w, s, dgates, dstate_next, dx, nullptr, dprev_state, g, scratch, stream, d_aux);
}

void backward_add_dx(GemmRunner& gemm, const Dims& d, const bf16* x, const float* prev_state, const Weights& w,
                     const Saved& s, const float* dgates, const float* dstate_next, float* dx_sum,
                     float* dprev_state, const Grads& g, void* scratch, cudaStream_t stream, float d_aux) {
  backward_impl(gemm, d, x, prev_state, w, s, dgates, dstate_next, nullptr, dx_sum, dprev_state, g, scratch, stream,
                d_aux);
}

void skip_forward(const bf16* x, const std::int32_t* idx, const float* gates, int skip_class, float* y,
                  std::int64_t tokens, std::int64_t hidden, cudaStream_t stream) {
  if (tokens < 0 || hidden <= 0) fail("cuda zaya_router skip: bad extents {} x {}", tokens, hidden);
  if (tokens == 0) return;
  skip_forward_kernel<<<grid_for(tokens, 8), 256, 0, stream>>>(x, idx, gates, skip_class, y, tokens, hidden);
  KEEL_CUDA_CHECK_LAUNCH();
}

namespace {

template <typename DX>
void skip_backward_impl(const bf16* x, const std::int32_t* idx, const float* gates, int skip_class, const float* dy,
                        DX* dx, float* dgates, std::int64_t tokens, std::int64_t hidden, cudaStream_t stream) {
  if (tokens < 0 || hidden <= 0) fail("cuda zaya_router skip: bad extents {} x {}", tokens, hidden);
  if (tokens == 0 || (!dx && !dgates)) return;
  skip_backward_kernel<DX><<<grid_for(tokens, 8), 256, 0, stream>>>(x, idx, gates, skip_class, dy, dx, dgates, tokens,
                                                                    hidden);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void skip_backward(const bf16* x, const std::int32_t* idx, const float* gates, int skip_class, const float* dy,
                   bf16* dx, float* dgates, std::int64_t tokens, std::int64_t hidden, cudaStream_t stream) {
  skip_backward_impl(x, idx, gates, skip_class, dy, dx, dgates, tokens, hidden, stream);
}
void skip_backward(const bf16* x, const std::int32_t* idx, const float* gates, int skip_class, const float* dy,
                   float* dx, float* dgates, std::int64_t tokens, std::int64_t hidden, cudaStream_t stream) {
  skip_backward_impl(x, idx, gates, skip_class, dy, dx, dgates, tokens, hidden, stream);
}

}  // namespace keel::ops::cuda::zaya_router

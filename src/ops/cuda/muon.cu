#include "ops/cuda/muon.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "optim/muon_workspace.h"

namespace keel::ops::cuda::muon {

namespace {

constexpr int kThreads = 256;
constexpr float kNormEps = 1e-7f;  // optim::newton_schulz's default

// Per-matrix reductions split each matrix into optim::muon_reduction_chunks() blocks
// (blockIdx.x), one partial each, summed in a fixed order by a second kernel: deterministic, and
// enough blocks for one large matrix to use the whole GPU.
std::int64_t reduction_chunks(std::int64_t per_matrix) { return optim::muon_reduction_chunks(per_matrix); }

// The workspace, carved as optim::muon_workspace_layout() lays it out (keel size counts the same).
struct Workspace {
  bf16 *x = nullptr, *y = nullptr, *a = nullptr, *b = nullptr;
  double* partials = nullptr;
  double* factor = nullptr;  // per matrix: float(1 / (||U|| + eps)), then (exact_rms) k
};

Workspace carve(void* base, std::int64_t matrices, std::int64_t rows, std::int64_t cols) {
  const optim::MuonWorkspaceLayout l = optim::muon_workspace_layout(matrices, rows, cols);
  auto* p = static_cast<std::byte*>(base);
  Workspace w;
  w.x = reinterpret_cast<bf16*>(p + l.x);
  w.y = reinterpret_cast<bf16*>(p + l.y);
  w.a = reinterpret_cast<bf16*>(p + l.a);
  w.b = reinterpret_cast<bf16*>(p + l.b);
  w.partials = reinterpret_cast<double*>(p + l.partials);
  w.factor = reinterpret_cast<double*>(p + l.factor);
  return w;
}

struct MomentumArgs {
  float beta, one_beta, host_scale;
  bool nesterov;
};

// The elementwise kernels below move W consecutive elements per load: W = 4 (16-byte fp32 and
// 8-byte bf16 vectors) when every matrix's elements are aligned so (matrix_step checks), else
// W = 1. They are bound by HBM bandwidth (a 16-matrix stack of 2048 x 2048 streams about 2.3 GB
// through them per step), and scalar 4-byte loads left much of it unused. fp32 arrays read or
// written once per step go evict-first (ld/st.global.cs), as in adamw.cu.
template <int W>
__device__ inline void load(const float* __restrict__ p, std::int64_t unit, float (&v)[W]) {
  if constexpr (W == 4) {
    const float4 f = __ldcs(reinterpret_cast<const float4*>(p) + unit);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    v[0] = __ldcs(p + unit);
  }
}
template <int W>
__device__ inline void store(float* __restrict__ p, std::int64_t unit, const float (&v)[W]) {
  if constexpr (W == 4)
    __stcs(reinterpret_cast<float4*>(p) + unit, make_float4(v[0], v[1], v[2], v[3]));
  else
    __stcs(p + unit, v[0]);
}
template <int W>
__device__ inline void load(const bf16* __restrict__ p, std::int64_t unit, float (&v)[W]) {
  if constexpr (W == 4)
    load_bf16<4>(p + 4 * unit, v);
  else
    v[0] = __bfloat162float(p[unit]);
}
template <int W>
__device__ inline void store(bf16* __restrict__ p, std::int64_t unit, const float (&v)[W]) {
  if constexpr (W == 4)
    store_bf16<4>(p + 4 * unit, v);
  else
    p[unit] = __float2bfloat16(v[0]);
}

// The element range of one block: matrix blockIdx.y, units [begin, end) of it, where a matrix
// has `units` units of W elements split into gridDim.x chunks of chunk_len units.
struct Chunk {
  std::int64_t matrix_offset, begin, end;  // matrix_offset in units
};
__device__ inline Chunk block_chunk(std::int64_t units, std::int64_t chunk_len) {
  const std::int64_t begin = blockIdx.x * chunk_len;
  return {static_cast<std::int64_t>(blockIdx.y) * units, begin, min(units, begin + chunk_len)};
}

// The momentum update and U of one element, every multiply and add rounded on its own (no
// FMA contraction) as the CPU reference computes them; shared by both kernels that need U.
__device__ inline float momentum_and_u(float grad, float& m, const MomentumArgs& a, float scale) {
  const float g = __fmul_rn(scale, grad);
  const float mi = __fadd_rn(__fmul_rn(a.beta, m), __fmul_rn(a.one_beta, g));
  m = mi;
  return a.nesterov ? __fadd_rn(__fmul_rn(a.one_beta, g), __fmul_rn(a.beta, mi)) : mi;
}

// grid (chunks, matrices): updates the momentum of the chunk and writes the partial sum of U^2.
template <int W>
__global__ void momentum_kernel(const float* __restrict__ grad, float* __restrict__ momentum, std::int64_t units,
                                std::int64_t chunk_len, MomentumArgs a, const float* __restrict__ device_scale,
                                double* __restrict__ partials) {
  const float scale = effective_grad_scale(a.host_scale, device_scale);
  if (!isfinite(scale)) return;  // the step is skipped (see muon.h)
  const Chunk c = block_chunk(units, chunk_len);
  double acc = 0;
#pragma unroll 2
  for (std::int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    float g[W], m[W];
    load<W>(grad, c.matrix_offset + i, g);
    load<W>(momentum, c.matrix_offset + i, m);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float u = momentum_and_u(g[j], m[j], a, scale);
      acc += static_cast<double>(u) * u;
    }
    // plain store: normalize_kernel reads the momentum right back
    if constexpr (W == 4)
      reinterpret_cast<float4*>(momentum)[c.matrix_offset + i] = make_float4(m[0], m[1], m[2], m[3]);
    else
      momentum[c.matrix_offset + i] = m[0];
  }
  const double total = block_sum_to_thread0<kThreads>(acc);
  if (threadIdx.x == 0) partials[blockIdx.y * gridDim.x + blockIdx.x] = total;
}

// grid (matrices): factor[e] = 1 / (sqrt(sum of the partials) + eps), as newton_schulz() does.
__global__ void inv_norm_kernel(const double* __restrict__ partials, int chunks, double* __restrict__ factor) {
  double acc = 0;
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) acc += partials[blockIdx.x * chunks + i];
  const double total = block_sum_to_thread0<kThreads>(acc);
  // rounded to fp32 once, as newton_schulz() does
  if (threadIdx.x == 0) factor[blockIdx.x] = static_cast<float>(1.0 / (sqrt(total) + static_cast<double>(kNormEps)));
}

// grid (chunks, matrices): X0 = bf16(U * factor[e]), U recomputed from the gradient and the
// already updated momentum M: U = (1 - beta) g + beta M (Nesterov) or M.
template <int W>
__global__ void normalize_kernel(const float* __restrict__ grad, const float* __restrict__ momentum,
                                 std::int64_t units, std::int64_t chunk_len, MomentumArgs a,
                                 const float* __restrict__ device_scale, const double* __restrict__ factor,
                                 bf16* __restrict__ x) {
  const float scale = effective_grad_scale(a.host_scale, device_scale);
  if (!isfinite(scale)) return;
  const Chunk c = block_chunk(units, chunk_len);
  const float f = static_cast<float>(factor[blockIdx.y]);
#pragma unroll 2
  for (std::int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    float m[W], u[W];
    load<W>(momentum, c.matrix_offset + i, m);
    if (a.nesterov) load<W>(grad, c.matrix_offset + i, u);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float uj =
          a.nesterov ? __fadd_rn(__fmul_rn(a.one_beta, __fmul_rn(scale, u[j])), __fmul_rn(a.beta, m[j])) : m[j];
      u[j] = __fmul_rn(uj, f);
    }
    store<W>(x, c.matrix_offset + i, u);
  }
}

// grid (chunks, matrices): partial sums of X^2 (exact_rms).
template <int W>
__global__ void x_squares_kernel(const bf16* __restrict__ x, std::int64_t units, std::int64_t chunk_len,
                                 double* __restrict__ partials) {
  const Chunk c = block_chunk(units, chunk_len);
  double acc = 0;
  for (std::int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    float v[W];
    load<W>(x, c.matrix_offset + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) acc += static_cast<double>(v[j]) * v[j];
  }
  const double total = block_sum_to_thread0<kThreads>(acc);
  if (threadIdx.x == 0) partials[blockIdx.y * gridDim.x + blockIdx.x] = total;
}

// grid (matrices): factor[e] = k_e = rms_target / RMS(X_e) (0 for a zero X), in fp64.
__global__ void exact_rms_kernel(const double* __restrict__ partials, int chunks, std::int64_t mn,
                                 double rms_target, double* __restrict__ factor) {
  double acc = 0;
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) acc += partials[blockIdx.x * chunks + i];
  const double total = block_sum_to_thread0<kThreads>(acc);
  if (threadIdx.x == 0) {
    const double rms = sqrt(total / static_cast<double>(mn));
    factor[blockIdx.x] = rms > 0 ? rms_target / rms : 0.0;
  }
}

struct UpdateArgs {
  float keep;   // 1 - lr wd
  float step;   // lr k (when there is no per-matrix k)
  float k;      // k, for update_out (likewise)
  float host_scale;
  double lr;    // with a per-matrix k: step = float(lr k), as the CPU rounds it
};

// grid (chunks, matrices): p = p keep - step X; param_bf16 = bf16(p); update_out = k X.
template <int W>
__global__ void update_kernel(float* __restrict__ param, bf16* __restrict__ param_bf16, const bf16* __restrict__ x,
                              std::int64_t units, std::int64_t chunk_len, UpdateArgs a,
                              const float* __restrict__ device_scale, const double* __restrict__ factor,
                              float* __restrict__ update_out) {
  if (!isfinite(effective_grad_scale(a.host_scale, device_scale))) return;
  const Chunk c = block_chunk(units, chunk_len);
  const float step = factor ? static_cast<float>(a.lr * factor[blockIdx.y]) : a.step;
  const float k = factor ? static_cast<float>(factor[blockIdx.y]) : a.k;
#pragma unroll 2
  for (std::int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
    const std::int64_t unit = c.matrix_offset + i;
    float xv[W], p[W];
    load<W>(x, unit, xv);
    load<W>(param, unit, p);
#pragma unroll
    for (int j = 0; j < W; ++j) p[j] = __fsub_rn(__fmul_rn(p[j], a.keep), __fmul_rn(step, xv[j]));
    store<W>(param, unit, p);
    if (param_bf16) store<W>(param_bf16, unit, p);
    if (update_out) {
#pragma unroll
      for (int j = 0; j < W; ++j) xv[j] = __fmul_rn(k, xv[j]);
      store<W>(update_out, unit, xv);
    }
  }
}


// The launch shape of the per-chunk kernels at vector width W: grid (chunks, matrices), each
// matrix `units` units of W elements in chunks of `chunk_len` units.
struct ChunkGrid {
  std::int64_t chunks, units, chunk_len;
  dim3 grid;
};
template <int W>
ChunkGrid chunk_grid(std::int64_t matrices, std::int64_t mn) {
  const std::int64_t chunks = reduction_chunks(mn), units = mn / W;
  return {chunks, units, (units + chunks - 1) / chunks,
          dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(matrices))};
}

// Before Newton-Schulz at vector width W: momentum, ||U||, X0 into w.x.
template <int W>
void momentum_and_x0(const float* grad, float* momentum, std::int64_t matrices, std::int64_t mn,
                     const MomentumArgs& ma, const float* device_grad_scale, const Workspace& w,
                     cudaStream_t stream) {
  const ChunkGrid g = chunk_grid<W>(matrices, mn);
  momentum_kernel<W><<<g.grid, kThreads, 0, stream>>>(grad, momentum, g.units, g.chunk_len, ma, device_grad_scale,
                                                    w.partials);
  KEEL_CUDA_CHECK_LAUNCH();
  inv_norm_kernel<<<static_cast<unsigned>(matrices), kThreads, 0, stream>>>(w.partials, static_cast<int>(g.chunks),
                                                                            w.factor);
  KEEL_CUDA_CHECK_LAUNCH();
  normalize_kernel<W><<<g.grid, kThreads, 0, stream>>>(grad, momentum, g.units, g.chunk_len, ma, device_grad_scale,
                                                     w.factor, w.x);
  KEEL_CUDA_CHECK_LAUNCH();
}

// After Newton-Schulz at vector width W: the exact-RMS factors when asked for, then the update
// from the final iterate x.
template <int W>
void scale_and_update(float* param, bf16* param_bf16, const bf16* x, std::int64_t matrices, std::int64_t mn,
                      const optim::MuonConfig& c, const UpdateArgs& ua, const float* device_grad_scale,
                      const Workspace& w, float* update_out, cudaStream_t stream) {
  const ChunkGrid g = chunk_grid<W>(matrices, mn);
  const double* factor = nullptr;
  if (c.scale == optim::MuonScale::kExactRms) {
    x_squares_kernel<W><<<g.grid, kThreads, 0, stream>>>(x, g.units, g.chunk_len, w.partials);
    KEEL_CUDA_CHECK_LAUNCH();
    exact_rms_kernel<<<static_cast<unsigned>(matrices), kThreads, 0, stream>>>(
        w.partials, static_cast<int>(g.chunks), mn, c.rms_target, w.factor);
    KEEL_CUDA_CHECK_LAUNCH();
    factor = w.factor;
  }
  update_kernel<W><<<g.grid, kThreads, 0, stream>>>(param, param_bf16, x, g.units, g.chunk_len, ua, device_grad_scale,
                                                  factor, update_out);
  KEEL_CUDA_CHECK_LAUNCH();
}

// Tensor parallelism: the momentum update and U of a block, elementwise (grid-stride).
__global__ void block_momentum_kernel(const float* __restrict__ grad, float* __restrict__ momentum,
                                      float* __restrict__ u, std::int64_t n, MomentumArgs a,
                                      const float* __restrict__ device_scale) {
  const float scale = effective_grad_scale(a.host_scale, device_scale);
  if (!isfinite(scale)) return;  // the step is skipped (see muon.h)
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float m = momentum[i];
    u[i] = momentum_and_u(grad[i], m, a, scale);
    momentum[i] = m;
  }
}

// p = p keep - lr kx, param_bf16 = bf16(p) (grid-stride).
__global__ void block_update_kernel(float* __restrict__ param, bf16* __restrict__ param_bf16,
                                    const float* __restrict__ kx, std::int64_t n, float keep, float lr,
                                    float host_scale, const float* __restrict__ device_scale) {
  if (!isfinite(effective_grad_scale(host_scale, device_scale))) return;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float p = __fsub_rn(__fmul_rn(param[i], keep), __fmul_rn(lr, kx[i]));
    param[i] = p;
    if (param_bf16) param_bf16[i] = __float2bfloat16(p);
  }
}

unsigned grid_of(std::int64_t n) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, 65535));
}

}  // namespace

void block_momentum(const float* grad, float* momentum, float* u, std::int64_t n, const optim::MuonConfig& c,
                    float grad_scale, const float* device_grad_scale, cudaStream_t stream) {
  if (n < 0) fail("muon: bad block of {} elements", n);
  if (!std::isfinite(grad_scale)) fail("muon: grad_scale is not finite ({})", grad_scale);
  if (n == 0) return;
  const MomentumArgs ma{static_cast<float>(c.momentum), static_cast<float>(1.0 - c.momentum), grad_scale, c.nesterov};
  block_momentum_kernel<<<grid_of(n), kThreads, 0, stream>>>(grad, momentum, u, n, ma, device_grad_scale);
  KEEL_CUDA_CHECK_LAUNCH();
}

void block_update(float* param, bf16* param_bf16, const float* kx, std::int64_t n, const optim::MuonConfig& c,
                  double lr, bool decay, float grad_scale, const float* device_grad_scale, cudaStream_t stream) {
  if (n < 0) fail("muon: bad block of {} elements", n);
  if (!(std::isfinite(lr) && lr >= 0)) fail("muon: lr must be finite and >= 0, got {}", lr);
  if (n == 0) return;
  const double wd = decay ? lr * c.weight_decay : 0.0;
  block_update_kernel<<<grid_of(n), kThreads, 0, stream>>>(param, param_bf16, kx, n, static_cast<float>(1.0 - wd),
                                                          static_cast<float>(lr), grad_scale, device_grad_scale);
  KEEL_CUDA_CHECK_LAUNCH();
}

std::size_t workspace_bytes(std::int64_t matrices, std::int64_t rows, std::int64_t cols) {
  return optim::muon_workspace_layout(matrices, rows, cols).bytes;
}

std::size_t workspace_bytes(const optim::ParamLayout& layout) { return optim::muon_workspace_bytes(layout); }

void matrix_step(float* param, const float* grad, float* momentum, bf16* param_bf16, std::int64_t matrices,
                 std::int64_t rows, std::int64_t cols, const optim::MuonConfig& c, double lr, bool decay,
                 float grad_scale, const float* device_grad_scale, void* workspace, GemmRunner& gemm,
                 cudaStream_t stream, float* update_out) {
  if (matrices < 1 || rows < 1 || cols < 1) fail("muon: bad matrix batch {} x [{}, {}]", matrices, rows, cols);
  if (matrices > 65535) fail("muon: {} matrices in one parameter (at most 65535)", matrices);
  if (!(std::isfinite(lr) && lr >= 0)) fail("muon: lr must be finite and >= 0, got {}", lr);
  if (!std::isfinite(grad_scale)) fail("muon: grad_scale is not finite ({})", grad_scale);
  if (!workspace) fail("muon: no workspace (need {} bytes)", workspace_bytes(matrices, rows, cols));
  optim::validate(c);
  const Workspace w = carve(workspace, matrices, rows, cols);
  const std::int64_t mn = rows * cols;
  const MomentumArgs ma{static_cast<float>(c.momentum), static_cast<float>(1.0 - c.momentum), grad_scale, c.nesterov};
  // 4-wide when every matrix starts on a 16-byte boundary (fp32; 8 bytes for bf16)
  const bool vec = mn % 4 == 0 && aligned_to(param, 16) && aligned_to(grad, 16) && aligned_to(momentum, 16) &&
                   (!param_bf16 || aligned_to(param_bf16, 8)) && (!update_out || aligned_to(update_out, 16));

  // 1. momentum, ||U||, X0
  if (vec)
    momentum_and_x0<4>(grad, momentum, matrices, mn, ma, device_grad_scale, w, stream);
  else
    momentum_and_x0<1>(grad, momentum, matrices, mn, ma, device_grad_scale, w, stream);

  // 2. Newton-Schulz on the bf16 iterate, batched over the matrices
  const bool tall = rows > cols;
  const std::int64_t s = tall ? cols : rows, l = tall ? rows : cols;
  const int batch = static_cast<int>(matrices);
  const float ka = static_cast<float>(c.coeffs.a), kb = static_cast<float>(c.coeffs.b),
              kc = static_cast<float>(c.coeffs.c);
  bf16 *x = w.x, *y = w.y;
  // The three GEMMs of an iteration, batched over the matrices (strides: X mn, A and B s x s).
  GemmDesc gram, square, next;
  gram.m = s, gram.n = s, gram.k = l, gram.trans_a = tall, gram.trans_b = !tall;
  square.m = s, square.n = s, square.k = s, square.alpha = kc, square.beta = kb;
  next.m = tall ? l : s, next.n = tall ? s : l, next.k = s, next.trans_b = tall, next.beta = ka;
  for (GemmDesc* d : {&gram, &square, &next}) d->batch = batch;
  if (batch > 1) {
    gram.stride_a = gram.stride_b = mn, gram.stride_c = s * s;
    square.stride_a = square.stride_b = square.stride_c = s * s;
    next.stride_a = tall ? mn : s * s, next.stride_b = tall ? s * s : mn, next.stride_c = mn;
  }
  for (int it = 0; it < c.ns_steps; ++it) {
    // A = X X^T (wide, X [s, l]) or X^T X (tall, X [l, s]): [s, s]
    gemm.run(gram, x, x, w.a, stream);
    // B = b A + c A A: b A read as the GEMM's C input, so no elementwise pass over A
    gemm.run(square, w.a, w.a, w.a, w.b, stream);
    // X' = a X + B X (wide) or a X + X B^T (tall): a X likewise read as the C input
    if (tall)
      gemm.run(next, x, w.b, x, y, stream);
    else
      gemm.run(next, w.b, x, x, y, stream);
    std::swap(x, y);
  }

  // 3. scale and update
  const double k = optim::muon_scale(c, rows, cols);
  const double wd = decay ? lr * c.weight_decay : 0.0;
  UpdateArgs ua{static_cast<float>(1.0 - wd), static_cast<float>(lr * k), static_cast<float>(k), grad_scale, lr};
  if (vec)
    scale_and_update<4>(param, param_bf16, x, matrices, mn, c, ua, device_grad_scale, w, update_out, stream);
  else
    scale_and_update<1>(param, param_bf16, x, matrices, mn, c, ua, device_grad_scale, w, update_out, stream);
}

DeviceMuon::DeviceMuon(const optim::MuonConfig& c) : c_(c) { optim::validate(c_); }

void DeviceMuon::step(const optim::ParamLayout& layout, float* params, const float* grads, float* momentum,
                      bf16* params_bf16, double lr, float grad_scale, const float* device_grad_scale, void* workspace,
                      GemmRunner& gemm, cudaStream_t stream) {
  for (const auto& p : layout.params) {
    if (p.optimizer != optim::OptimizerKind::kMuon) continue;
    if (p.ndim() < 2) fail("muon: parameter '{}' has {} dims; Muon needs >= 2", p.name, p.ndim());
    matrix_step(params + p.offset, grads + p.offset, momentum + p.offset,
                params_bf16 ? params_bf16 + p.offset : nullptr, p.matrices(), p.rows(), p.cols(), c_,
                lr * p.lr_scale, p.weight_decay, grad_scale, device_grad_scale, workspace, gemm, stream);
  }
}

}  // namespace keel::ops::cuda::muon

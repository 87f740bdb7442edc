#include "ops/cuda/muon.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace keel::ops::cuda::muon {

namespace {

constexpr int kThreads = 256;
constexpr float kNormEps = 1e-7f;  // optim::newton_schulz's default

// Per-matrix reductions split each matrix into `chunks` blocks (blockIdx.x), one partial each,
// summed in a fixed order by a second kernel: deterministic, and enough blocks for one large
// matrix to use the whole GPU.
std::int64_t reduction_chunks(std::int64_t per_matrix) {
  return std::clamp<std::int64_t>((per_matrix + kThreads * 16 - 1) / (kThreads * 16), 1, 256);
}

std::size_t round_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// The workspace, carved in this order (each region 256-byte aligned).
struct Workspace {
  bf16 *x = nullptr, *y = nullptr, *a = nullptr, *b = nullptr;
  double* partials = nullptr;
  double* factor = nullptr;  // per matrix: float(1 / (||U|| + eps)), then (exact_rms) k
  std::size_t bytes = 0;
};

Workspace carve(void* base, std::int64_t matrices, std::int64_t rows, std::int64_t cols) {
  const std::int64_t s = std::min(rows, cols), mn = rows * cols;
  Workspace w;
  auto* p = static_cast<std::byte*>(base);
  auto take = [&](std::size_t bytes) {
    std::byte* at = p ? p + w.bytes : nullptr;
    w.bytes += round_up(bytes);
    return at;
  };
  w.x = reinterpret_cast<bf16*>(take(sizeof(bf16) * matrices * mn));
  w.y = reinterpret_cast<bf16*>(take(sizeof(bf16) * matrices * mn));
  w.a = reinterpret_cast<bf16*>(take(sizeof(bf16) * matrices * s * s));
  w.b = reinterpret_cast<bf16*>(take(sizeof(bf16) * matrices * s * s));
  w.partials = reinterpret_cast<double*>(take(sizeof(double) * matrices * reduction_chunks(mn)));
  w.factor = reinterpret_cast<double*>(take(sizeof(double) * matrices));
  return w;
}

struct MomentumArgs {
  float beta, one_beta, host_scale;
  bool nesterov;
};

// The momentum update and U of one element, every multiply and add rounded on its own (no
// FMA contraction) as the CPU reference computes them; shared by both kernels that need U.
__device__ inline float momentum_and_u(float grad, float& m, const MomentumArgs& a, float scale) {
  const float g = __fmul_rn(scale, grad);
  const float mi = __fadd_rn(__fmul_rn(a.beta, m), __fmul_rn(a.one_beta, g));
  m = mi;
  return a.nesterov ? __fadd_rn(__fmul_rn(a.one_beta, g), __fmul_rn(a.beta, mi)) : mi;
}

// grid (chunks, matrices): updates the momentum of the chunk and writes the partial sum of U^2.
__global__ void momentum_kernel(const float* __restrict__ grad, float* __restrict__ momentum, std::int64_t mn,
                                std::int64_t chunk_len, MomentumArgs a, const float* __restrict__ device_scale,
                                double* __restrict__ partials) {
  const float scale = effective_grad_scale(a.host_scale, device_scale);
  if (!isfinite(scale)) return;  // the step is skipped (see muon.h)
  const std::int64_t e = blockIdx.y, begin = blockIdx.x * chunk_len, end = min(mn, begin + chunk_len);
  const float* g = grad + e * mn;
  float* m = momentum + e * mn;
  double acc = 0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float mi = m[i];
    const float u = momentum_and_u(g[i], mi, a, scale);
    m[i] = mi;
    acc += static_cast<double>(u) * u;
  }
  const double total = block_sum_to_thread0<kThreads>(acc);
  if (threadIdx.x == 0) partials[e * gridDim.x + blockIdx.x] = total;
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
__global__ void normalize_kernel(const float* __restrict__ grad, const float* __restrict__ momentum, std::int64_t mn,
                                 std::int64_t chunk_len, MomentumArgs a, const float* __restrict__ device_scale,
                                 const double* __restrict__ factor, bf16* __restrict__ x) {
  const float scale = effective_grad_scale(a.host_scale, device_scale);
  if (!isfinite(scale)) return;
  const std::int64_t e = blockIdx.y, begin = blockIdx.x * chunk_len, end = min(mn, begin + chunk_len);
  const float f = static_cast<float>(factor[e]);
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float mi = momentum[e * mn + i];
    const float u =
        a.nesterov ? __fadd_rn(__fmul_rn(a.one_beta, __fmul_rn(scale, grad[e * mn + i])), __fmul_rn(a.beta, mi)) : mi;
    x[e * mn + i] = __float2bfloat16(__fmul_rn(u, f));
  }
}

// grid (chunks, matrices): partial sums of X^2 (exact_rms).
__global__ void x_squares_kernel(const bf16* __restrict__ x, std::int64_t mn, std::int64_t chunk_len,
                                 double* __restrict__ partials) {
  const std::int64_t e = blockIdx.y, begin = blockIdx.x * chunk_len, end = min(mn, begin + chunk_len);
  double acc = 0;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const double v = __bfloat162float(x[e * mn + i]);
    acc += v * v;
  }
  const double total = block_sum_to_thread0<kThreads>(acc);
  if (threadIdx.x == 0) partials[e * gridDim.x + blockIdx.x] = total;
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
__global__ void update_kernel(float* __restrict__ param, bf16* __restrict__ param_bf16, const bf16* __restrict__ x,
                              std::int64_t mn, std::int64_t chunk_len, UpdateArgs a,
                              const float* __restrict__ device_scale, const double* __restrict__ factor,
                              float* __restrict__ update_out) {
  if (!isfinite(effective_grad_scale(a.host_scale, device_scale))) return;
  const std::int64_t e = blockIdx.y, begin = blockIdx.x * chunk_len, end = min(mn, begin + chunk_len);
  const float step = factor ? static_cast<float>(a.lr * factor[e]) : a.step;
  const float k = factor ? static_cast<float>(factor[e]) : a.k;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const std::int64_t j = e * mn + i;
    const float xi = __bfloat162float(x[j]);
    const float p = __fsub_rn(__fmul_rn(param[j], a.keep), __fmul_rn(step, xi));
    param[j] = p;
    if (param_bf16) param_bf16[j] = __float2bfloat16(p);
    if (update_out) update_out[j] = __fmul_rn(k, xi);
  }
}

}  // namespace

std::size_t workspace_bytes(std::int64_t matrices, std::int64_t rows, std::int64_t cols) {
  if (matrices < 1 || rows < 1 || cols < 1) fail("muon: bad matrix batch {} x [{}, {}]", matrices, rows, cols);
  return carve(nullptr, matrices, rows, cols).bytes;
}

std::size_t workspace_bytes(const optim::ParamLayout& layout) {
  std::size_t n = 0;
  for (const auto& p : layout.params)
    if (p.optimizer == optim::OptimizerKind::kMuon) n = std::max(n, workspace_bytes(p.matrices(), p.rows(), p.cols()));
  return n;
}

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
  const std::int64_t chunks = reduction_chunks(mn), chunk_len = (mn + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(matrices));
  const MomentumArgs ma{static_cast<float>(c.momentum), static_cast<float>(1.0 - c.momentum), grad_scale, c.nesterov};

  // 1. momentum, ||U||, X0
  momentum_kernel<<<grid, kThreads, 0, stream>>>(grad, momentum, mn, chunk_len, ma, device_grad_scale, w.partials);
  KEEL_CUDA_CHECK_LAUNCH();
  inv_norm_kernel<<<static_cast<unsigned>(matrices), kThreads, 0, stream>>>(w.partials, static_cast<int>(chunks),
                                                                            w.factor);
  KEEL_CUDA_CHECK_LAUNCH();
  normalize_kernel<<<grid, kThreads, 0, stream>>>(grad, momentum, mn, chunk_len, ma, device_grad_scale, w.factor, w.x);
  KEEL_CUDA_CHECK_LAUNCH();

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
  const double* factor = nullptr;
  if (c.scale == optim::MuonScale::kExactRms) {
    x_squares_kernel<<<grid, kThreads, 0, stream>>>(x, mn, chunk_len, w.partials);
    KEEL_CUDA_CHECK_LAUNCH();
    exact_rms_kernel<<<static_cast<unsigned>(matrices), kThreads, 0, stream>>>(
        w.partials, static_cast<int>(chunks), mn, c.rms_target, w.factor);
    KEEL_CUDA_CHECK_LAUNCH();
    factor = w.factor;
  }
  update_kernel<<<grid, kThreads, 0, stream>>>(param, param_bf16, x, mn, chunk_len, ua, device_grad_scale, factor,
                                                update_out);
  KEEL_CUDA_CHECK_LAUNCH();
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

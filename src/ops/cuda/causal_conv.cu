#include "ops/cuda/causal_conv.h"

#include <algorithm>

#include "common/error.h"

namespace keel::ops::cuda::causal_conv {

namespace {

constexpr int kThreads = 256;
constexpr int kColThreads = 128;
constexpr int kTargetBlocks = 528;  // ~4 blocks per SM on an H100 (132 SMs)

// ---------------------------------------------------------------- depthwise

// One block per output row (bi, t) of the B * (T + extra) rows, threads over the channels:
// the row's indices cost one division per block, not per element. Input times ts < 0 read the
// halo (sequence bi's at halo + bi * hstride, row ts + P, P = extra + W - 1) or, without one,
// zero.
__global__ void depthwise_forward_kernel(const bf16* __restrict__ x, const float* __restrict__ w,
                                         const float* __restrict__ b, int extra, bf16* __restrict__ y, std::int64_t T,
                                         std::int64_t C, int W, const bf16* __restrict__ halo, std::int64_t hstride) {
  const std::int64_t To = T + extra, row = blockIdx.x, bi = row / To, t = row % To - extra, P = extra + W - 1;
  bf16* out = y + row * C;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = b ? b[c] : 0.f;
    for (int k = 0; k < W; ++k) {
      const std::int64_t ts = t - (W - 1) + k;
      const bf16* in = ts >= 0 ? x + (bi * T + ts) * C : halo ? halo + bi * hstride + (ts + P) * C : nullptr;
      if (in) acc += w[c * W + k] * __bfloat162float(in[c]);
    }
    out[c] = __float2bfloat16(acc);
  }
}

// One block per halo row (bi, h) of the B * P rows (input time s = h - P): the halo's gradient,
// dhalo[bi * hstride + h * C + c] = sum_k w[c, k] dy[row s + (W-1) - k + extra, c] (rows in range).
__global__ void depthwise_dhalo_kernel(const float* __restrict__ w, int extra, const float* __restrict__ dy,
                                       float* __restrict__ dhalo, std::int64_t T, std::int64_t C, int W,
                                       std::int64_t hstride) {
  const std::int64_t To = T + extra, P = extra + W - 1, row = blockIdx.x, bi = row / P, h = row % P, s = h - P;
  float* out = dhalo + bi * hstride + h * C;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < W; ++k) {
      const std::int64_t j = s + (W - 1) - k + extra;
      if (j >= 0 && j < To) acc += w[c * W + k] * dy[(bi * To + j) * C + c];
    }
    out[c] = acc;
  }
}

// One block per input row (bi, s) of the B * T rows.
__global__ void depthwise_dx_kernel(const float* __restrict__ w, int extra, const float* __restrict__ dy,
                                    float* __restrict__ dx, std::int64_t T, std::int64_t C, int W) {
  const std::int64_t To = T + extra, row = blockIdx.x, bi = row / T, s = row % T;
  float* out = dx + row * C;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = 0.f;
    for (int k = 0; k < W; ++k) {
      const std::int64_t j = s + (W - 1) - k + extra;  // output row fed by input time s through tap k
      if (j < To) acc += w[c * W + k] * dy[(bi * To + j) * C + c];
    }
    out[c] = acc;
  }
}

// Thread = channel, blockIdx.y = chunk of the B * To output rows.
__global__ void depthwise_dw_kernel(const bf16* __restrict__ x, int extra, const float* __restrict__ dy,
                                    float* __restrict__ dw, float* __restrict__ db, std::int64_t B, std::int64_t T,
                                    std::int64_t C, int W, std::int64_t chunk, const bf16* __restrict__ halo,
                                    std::int64_t hstride) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const std::int64_t To = T + extra, rows = B * To, P = extra + W - 1;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  float acc[kMaxWidth] = {};
  float accb = 0.f;
  // (bi, t) of row r, stepped along with r (a division per row would cost more than the row).
  std::int64_t bi = begin / To, t = begin % To - extra;
  for (std::int64_t r = begin; r < end; ++r, ++t) {
    if (t == T) bi += 1, t = -extra;
    const float g = dy[r * C + c];
    accb += g;
#pragma unroll
    for (int k = 0; k < kMaxWidth; ++k) {
      if (k >= W) break;
      const std::int64_t ts = t - (W - 1) + k;
      const bf16* in = ts >= 0 ? x + (bi * T + ts) * C : halo ? halo + bi * hstride + (ts + P) * C : nullptr;
      if (in) acc[k] += g * __bfloat162float(in[c]);
    }
  }
  const bool one = gridDim.y == 1;
  if (dw)
    for (int k = 0; k < W; ++k) {
      if (one)
        dw[c * W + k] += acc[k];
      else
        atomicAdd(dw + c * W + k, acc[k]);
    }
  if (db) {
    if (one)
      db[c] += accb;
    else
      atomicAdd(db + c, accb);
  }
}

// db[c] += sum over rows of dy[row, c].
__global__ void column_sum_kernel(const float* __restrict__ dy, float* __restrict__ db, std::int64_t rows,
                                  std::int64_t C, std::int64_t chunk) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  float acc = 0.f;
  for (std::int64_t r = begin; r < end; ++r) acc += dy[r * C + c];
  if (gridDim.y == 1)
    db[c] += acc;
  else
    atomicAdd(db + c, acc);
}

// ---------------------------------------------------------------- grouped, tensor cores

// wt[(k C + c) Cg + i] = bf16(w[(c Cg + i) W + k]).
__global__ void relayout_weights_kernel(const float* __restrict__ w, bf16* __restrict__ wt, std::int64_t C,
                                        std::int64_t Cg, int W) {
  const std::int64_t n = C * Cg * W;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e % Cg, c = (e / Cg) % C, k = e / (Cg * C);
    wt[e] = __float2bfloat16(w[(c * Cg + i) * W + k]);
  }
}

// One block per row of y [rows, C]: y = b (or 0), the GEMMs then accumulate onto it.
__global__ void fill_bias_kernel(const float* __restrict__ b, float* __restrict__ y, std::int64_t C) {
  float* row = y + static_cast<std::int64_t>(blockIdx.x) * C;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) row[c] = b ? b[c] : 0.f;
}

// One block per row of dyp [B, Ti, C] bf16: rows s < T of each sequence are dy's, the W - 1
// rows after them zero.
__global__ void pad_dy_kernel(const float* __restrict__ dy, bf16* __restrict__ dyp, std::int64_t T,
                              std::int64_t Ti, std::int64_t C) {
  const std::int64_t r = blockIdx.x, bi = r / Ti, s = r % Ti;
  bf16* out = dyp + r * C;
  const float* in = dy + (bi * T + s) * C;
  for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) out[c] = __float2bfloat16(s < T ? in[c] : 0.f);
}

// dw[(c Cg + i) W + k] += dwt[(k C + c) Cg + i].
__global__ void add_weight_grad_kernel(const float* __restrict__ dwt, float* __restrict__ dw, std::int64_t C,
                                       std::int64_t Cg, int W) {
  const std::int64_t n = C * Cg * W;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t k = e % W, ci = e / W;  // ci = c Cg + i
    dw[e] += dwt[k * C * Cg + ci];
  }
}

// ---------------------------------------------------------------- launch helpers

void check_common(std::int64_t B, std::int64_t T, std::int64_t C, int W, const char* what) {
  if (B < 0 || T < 0 || C <= 0) fail("causal_conv {}: need B, T >= 0 and C > 0, got B {}, T {}, C {}", what, B, T, C);
  if (W < 1 || W > kMaxWidth) fail("causal_conv {}: width {} outside [1, {}]", what, W, kMaxWidth);
}

// The elements between two sequences' halos: halo_stride, or 0 for packed [B, P, C] halos.
std::int64_t check_halo_stride(std::int64_t halo_stride, int extra, int W, std::int64_t C, const char* what) {
  const std::int64_t packed = (std::int64_t(extra) + W - 1) * C;
  if (halo_stride == 0) return packed;
  if (halo_stride < packed)
    fail("causal_conv {}: halo_stride {} is below one halo's (extra + W - 1) * C = {} elements", what, halo_stride,
         packed);
  return halo_stride;
}

}  // namespace

void depthwise_forward(const bf16* x, const float* w, const float* b, int extra, bf16* y, std::int64_t B,
                       std::int64_t T, std::int64_t C, int W, cudaStream_t stream, const bf16* halo,
                       std::int64_t halo_stride) {
  check_common(B, T, C, W, "depthwise_forward");
  if (extra < 0) fail("causal_conv depthwise_forward: extra must be >= 0, got {}", extra);
  const std::int64_t hstride = check_halo_stride(halo_stride, extra, W, C, "depthwise_forward");
  if (B == 0 || T == 0) return;
  if (B * (T + extra) > 0x7fffffff) fail("causal_conv depthwise_forward: {} rows exceed the grid", B * (T + extra));
  depthwise_forward_kernel<<<static_cast<unsigned>(B * (T + extra)), kThreads, 0, stream>>>(x, w, b, extra, y, T, C, W,
                                                                                         halo, hstride);
  KEEL_CUDA_CHECK_LAUNCH();
}

void depthwise_backward(const bf16* x, const float* w, int extra, const float* dy, float* dx, float* dw, float* db,
                        std::int64_t B, std::int64_t T, std::int64_t C, int W, cudaStream_t stream, const bf16* halo,
                        float* dhalo, std::int64_t halo_stride) {
  check_common(B, T, C, W, "depthwise_backward");
  if (extra < 0) fail("causal_conv depthwise_backward: extra must be >= 0, got {}", extra);
  const std::int64_t hstride = check_halo_stride(halo_stride, extra, W, C, "depthwise_backward");
  if (B == 0 || T == 0) return;
  if (dx) {
    if (B * T > 0x7fffffff) fail("causal_conv depthwise_backward: {} rows exceed the grid", B * T);
    depthwise_dx_kernel<<<static_cast<unsigned>(B * T), kThreads, 0, stream>>>(w, extra, dy, dx, T, C, W);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  const std::int64_t P = extra + W - 1;
  if (dhalo && P > 0) {
    if (B * P > 0x7fffffff) fail("causal_conv depthwise_backward: {} halo rows exceed the grid", B * P);
    depthwise_dhalo_kernel<<<static_cast<unsigned>(B * P), kThreads, 0, stream>>>(w, extra, dy, dhalo, T, C, W,
                                                                                 hstride);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  if (dw || db) {
    // Four times the usual block count: each thread walks its rows one dependent step at a
    // time, so it takes many threads in flight to keep the loads coming (4 x 528 blocks of
    // 128 threads fill an H100's or H200's SMs); the extra atomics are W + 1 per block and channel.
    const ColumnSplit s = column_split(B * (T + extra), C, kColThreads, 4 * kTargetBlocks);
    depthwise_dw_kernel<<<s.grid, kColThreads, 0, stream>>>(x, extra, dy, dw, db, B, T, C, W, s.chunk, halo, hstride);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

namespace {

std::size_t round_up_256(std::size_t b) { return (b + 255) / 256 * 256; }

void check_gemm(std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t Cg, int W, const char* what) {
  check_common(B, T, C, W, what);
  if (Cg < 1 || C % Cg != 0) fail("causal_conv {}: group width {} does not divide C = {}", what, Cg, C);
  if (C / Cg > 0x7fffffff) fail("causal_conv {}: too many groups ({})", what, C / Cg);
  if (B * (T + W - 1) > 0x7fffffff) fail("causal_conv {}: {} rows exceed the grid", what, B * (T + W - 1));
}

// The strided batch over the heads: head h's operands start h * Cg columns (h * Cg * Cg weight
// elements) further on.
GemmDesc head_batch(std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t C, std::int64_t Cg) {
  GemmDesc g;
  g.m = m, g.n = n, g.k = k;
  g.c_type = GemmOut::kFp32;
  g.batch = static_cast<int>(C / Cg);
  return g;
}

}  // namespace

void grouped_weights_bf16(const float* w, bf16* wt, std::int64_t C, std::int64_t Cg, int W, cudaStream_t stream) {
  check_common(1, 1, C, W, "grouped_weights_bf16");
  if (Cg < 1 || C % Cg != 0) fail("causal_conv grouped_weights_bf16: group width {} does not divide C = {}", Cg, C);
  relayout_weights_kernel<<<elementwise_grid(C * Cg * W, kThreads), kThreads, 0, stream>>>(w, wt, C, Cg, W);
  KEEL_CUDA_CHECK_LAUNCH();
}

void grouped_forward_gemm(GemmRunner& gemm, const bf16* x, const bf16* wt, const float* b, float* y, std::int64_t B,
                          std::int64_t T, std::int64_t C, std::int64_t Cg, int W, cudaStream_t stream) {
  check_gemm(B, T, C, Cg, W, "grouped_forward_gemm");
  if (B == 0 || T == 0) return;
  const std::int64_t Ti = T + W - 1;
  fill_bias_kernel<<<static_cast<unsigned>(B * T), kThreads, 0, stream>>>(b, y, C);
  KEEL_CUDA_CHECK_LAUNCH();
  // y_h[bi, t, :] += x_h[bi, t + k, :] W_k,h^T per tap and sequence (the rows of one sequence
  // are contiguous in x and in y, but the sequences are Ti apart in x and T apart in y).
  GemmDesc g = head_batch(T, Cg, Cg, C, Cg);
  g.trans_b = true;
  g.beta = 1.f;
  g.lda = C, g.ldb = Cg, g.ldc = C;
  g.stride_a = Cg, g.stride_b = Cg * Cg, g.stride_c = Cg;
  for (int k = 0; k < W; ++k)
    for (std::int64_t bi = 0; bi < B; ++bi)
      gemm.run(g, x + (bi * Ti + k) * C, wt + k * C * Cg, y + bi * T * C, stream);
}

std::size_t grouped_backward_gemm_scratch_bytes(std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t Cg,
                                                int W) {
  check_gemm(B, T, C, Cg, W, "grouped_backward_gemm");
  return round_up_256(static_cast<std::size_t>(B * (T + W - 1) * C) * sizeof(bf16)) +
         round_up_256(static_cast<std::size_t>(W * C * Cg) * sizeof(float));
}

void grouped_backward_gemm(GemmRunner& gemm, const bf16* x, const bf16* wt, const float* dy, float* dx, float* dw,
                           float* db, std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t Cg, int W,
                           void* scratch, cudaStream_t stream) {
  check_gemm(B, T, C, Cg, W, "grouped_backward_gemm");
  if (B == 0 || T == 0) return;
  const std::int64_t Ti = T + W - 1, rows = B * Ti;
  bf16* dyp = static_cast<bf16*>(scratch);
  float* dwt = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                        round_up_256(static_cast<std::size_t>(rows * C) * sizeof(bf16)));
  if (dx || dw) {
    pad_dy_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(dy, dyp, T, Ti, C);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  if (dx) {
    // dx_h[r] (+)= dyp_h[r - k] W_k,h over the flat rows r >= k: a row r - k in the padding
    // after a sequence is zero, so nothing leaks across sequences. Tap 0 covers every row.
    for (int k = 0; k < W; ++k) {
      GemmDesc g = head_batch(rows - k, Cg, Cg, C, Cg);
      g.beta = k == 0 ? 0.f : 1.f;
      g.lda = C, g.ldb = Cg, g.ldc = C;
      g.stride_a = Cg, g.stride_b = Cg * Cg, g.stride_c = Cg;
      gemm.run(g, dyp, wt + k * C * Cg, dx + k * C, stream);
    }
  }
  if (dw) {
    // dW_k,h = sum over the flat rows r of dyp_h[r]^T x_h[r + k] (padding rows of dyp are zero).
    for (int k = 0; k < W; ++k) {
      GemmDesc g = head_batch(Cg, Cg, rows - k, C, Cg);
      g.trans_a = true;
      g.lda = C, g.ldb = C, g.ldc = Cg;
      g.stride_a = Cg, g.stride_b = Cg, g.stride_c = Cg * Cg;
      gemm.run(g, dyp, x + k * C, dwt + k * C * Cg, stream);
    }
    add_weight_grad_kernel<<<elementwise_grid(C * Cg * W, kThreads), kThreads, 0, stream>>>(dwt, dw, C, Cg, W);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  if (db) {
    const ColumnSplit s = column_split(B * T, C, kColThreads, kTargetBlocks);
    column_sum_kernel<<<s.grid, kColThreads, 0, stream>>>(dy, db, B * T, C, s.chunk);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace keel::ops::cuda::causal_conv

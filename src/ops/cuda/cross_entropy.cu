#include "ops/cuda/cross_entropy.h"

#include <algorithm>

#include "common/error.h"
#include "ops/cuda/gemm.h"

namespace keel::ops::cuda::cross_entropy {

namespace {

constexpr int kRowThreads = 256;    // one block per row in the chunk kernels
constexpr int kFinalThreads = 1024;  // the single-block reductions over rows

struct Scratch {
  float* logits;     // [N, c] fp32
  bf16* dlogits;     // [N, c] bf16
  float* dhidden;    // [N, D] fp32
  float* row_max;    // [N]
  float* row_sum;    // [N]
  float* target;     // [N] target logit
  int* valid;        // [1]
};

std::int64_t align_up(std::int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The scratch layout, in order: the fp32 logit block [N, fp32_cols] (chunked mode; none when
// the logits are kept), the bf16 block [N, bf16_cols] (a chunk's dlogits, or the kept [N, V]
// logits that backward turns into dlogits in place), the fp32 dhidden accumulator and the row
// statistics. With base == nullptr only the total size is computed.
struct Carved {
  Scratch s;
  std::int64_t bytes = 0;
};
Carved carve_layout(void* base, std::int64_t n, std::int64_t d, std::int64_t fp32_cols, std::int64_t bf16_cols) {
  char* b = static_cast<char*>(base);
  Carved c;
  auto take = [&](std::int64_t bytes) {
    char* p = b ? b + c.bytes : nullptr;
    c.bytes += align_up(bytes);
    return p;
  };
  c.s.logits = fp32_cols > 0 ? reinterpret_cast<float*>(take(n * fp32_cols * 4)) : nullptr;
  c.s.dlogits = reinterpret_cast<bf16*>(take(n * bf16_cols * 2));
  c.s.dhidden = reinterpret_cast<float*>(take(n * d * 4));
  c.s.row_max = reinterpret_cast<float*>(take(n * 4));
  c.s.row_sum = reinterpret_cast<float*>(take(n * 4));
  c.s.target = reinterpret_cast<float*>(take(n * 4));
  c.s.valid = reinterpret_cast<int*>(take(4));
  return c;
}

Carved carve(void* base, std::int64_t n, std::int64_t d, std::int64_t v, const Options& o) {
  if (o.keep_logits) return carve_layout(base, n, d, 0, v);
  const std::int64_t c = std::min(o.chunk, v);
  return carve_layout(base, n, d, c, c);
}

// The slice mode's layout: the same over the slice's V_local columns, without the dhidden
// accumulator (its backward writes the caller's fp32 dhidden directly). Never larger than
// carve(base, n, d, V_local, o), and with the kept logits at the same offset.
Carved carve_slice(void* base, std::int64_t n, std::int64_t vocab_local, const Options& o) {
  return carve(base, n, 0, vocab_local, o);
}

__device__ inline bool is_valid(std::int32_t t, std::int32_t ignore, std::int64_t vocab) {
  return t != ignore && t >= 0 && t < vocab;
}

template <typename T>
struct Sum {
  __device__ T operator()(T a, T b) const { return a + b; }
};

// Reduction over a block of kThreads threads, result in every thread; fixed order.
template <int kThreads, typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T part[kThreads / 32];
  __shared__ T total;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    T w = threadIdx.x < kThreads / 32 ? part[threadIdx.x] : identity;
    for (int o = 16; o > 0; o >>= 1) w = op(w, __shfl_xor_sync(0xffffffffu, w, o));
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  return total;
}

__global__ void init_rows_kernel(float* row_max, float* row_sum, float* target, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  row_max[i] = -INFINITY;
  row_sum[i] = 0.f;
  target[i] = 0.f;
}

// 16-byte vectors of a row: 8 bf16 or 4 fp32 values, converted to / from fp32.
template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

__device__ inline void load_vec(const bf16* p, float* out) { load_bf16<8>(p, out); }
__device__ inline void load_vec(const float* p, float* out) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  out[0] = f.x, out[1] = f.y, out[2] = f.z, out[3] = f.w;
}

// Whether every row of a [rows, ld] block of T at `p` starts 16-byte aligned (the vector paths).
template <typename T>
bool rows_vectorizable(const void* p, std::int64_t ld) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && ld % kVecElems<T> == 0;
}

constexpr float kLog2e = 1.4426950408889634f;

// A running (max, sum of exp(x - max)) pair: one exp per element, the sum rescaled when the max
// grows. exp2 of a pre-scaled argument is one SFU instruction (the row pass is memory-bound
// only if the exps keep up with the loads).
struct MaxSum {
  float m = -INFINITY, s = 0.f;
  __device__ void fold(const float* x, int n) {
    float cm = m;
    for (int k = 0; k < n; ++k) cm = fmaxf(cm, x[k]);
    if (cm > m) {
      s *= exp2f((m - cm) * kLog2e);  // exp2(-inf) = 0 on the first values
      m = cm;
    }
    const float ms = m * kLog2e;
    for (int k = 0; k < n; ++k) s += exp2f(fmaf(x[k], kLog2e, -ms));
  }
};
__device__ inline MaxSum merge(MaxSum a, MaxSum b) {
  MaxSum r;
  r.m = fmaxf(a.m, b.m);
  if (r.m == -INFINITY) return r;  // both empty
  r.s = a.s * exp2f((a.m - r.m) * kLog2e) + b.s * exp2f((b.m - r.m) * kLog2e);
  return r;
}
// Block-wide merge in a fixed order (deterministic); the result in every thread.
template <int kThreads>
__device__ MaxSum block_merge(MaxSum v) {
  __shared__ float pm[kThreads / 32], ps[kThreads / 32];
  __shared__ MaxSum total;
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum w;
    w.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    w.s = __shfl_xor_sync(0xffffffffu, v.s, o);
    v = merge(v, w);
  }
  if (threadIdx.x % 32 == 0) pm[threadIdx.x / 32] = v.m, ps[threadIdx.x / 32] = v.s;
  __syncthreads();
  if (threadIdx.x < 32) {
    MaxSum w;
    if (threadIdx.x < kThreads / 32) w.m = pm[threadIdx.x], w.s = ps[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) {
      MaxSum u;
      u.m = __shfl_xor_sync(0xffffffffu, w.m, o);
      u.s = __shfl_xor_sync(0xffffffffu, w.s, o);
      w = merge(w, u);
    }
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  return total;
}

// Folds chunk [v0, v0 + cs) of row blockIdx.x into the running (max, sum) of that row, in one
// pass over the chunk. The chunk's logits are row i at logits + i * ld (fp32 chunk scratch, or
// the kept bf16 [N, V]). kVec: rows 16-byte aligned (rows_vectorizable), read 16 bytes at a
// time, two loads in flight per thread.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads) online_lse_kernel(
    const T* __restrict__ logits, std::int64_t ld, const std::int32_t* __restrict__ targets, std::int32_t ignore,
    std::int64_t vocab, std::int64_t v0, std::int64_t cs, float* __restrict__ row_max, float* __restrict__ row_sum,
    float* __restrict__ target) {
  const std::int64_t i = blockIdx.x;
  const std::int32_t t = targets[i];
  if (!is_valid(t, ignore, vocab)) return;  // uniform over the block
  const T* l = logits + i * ld;
  MaxSum acc;
  std::int64_t tail = 0;
  if constexpr (kVec) {
    constexpr int kN = kVecElems<T>;
    const std::int64_t nvec = cs / kN;
    std::int64_t q = threadIdx.x;
    for (; q + kRowThreads < nvec; q += 2 * kRowThreads) {
      float a[kN], b[kN];
      load_vec(l + q * kN, a);
      load_vec(l + (q + kRowThreads) * kN, b);
      acc.fold(a, kN);
      acc.fold(b, kN);
    }
    if (q < nvec) {
      float a[kN];
      load_vec(l + q * kN, a);
      acc.fold(a, kN);
    }
    tail = nvec * kN;
  }
  for (std::int64_t j = tail + threadIdx.x; j < cs; j += kRowThreads) {
    const float x = static_cast<float>(l[j]);
    acc.fold(&x, 1);
  }
  const MaxSum chunk = block_merge<kRowThreads>(acc);
  if (threadIdx.x == 0) {
    MaxSum row;
    row.m = row_max[i], row.s = row_sum[i];
    row = merge(row, chunk);
    row_sum[i] = row.s;
    row_max[i] = row.m;
    if (t >= v0 && t < v0 + cs) target[i] = static_cast<float>(l[t - v0]);
  }
}

__global__ void finish_forward_kernel(const std::int32_t* __restrict__ targets, std::int32_t ignore,
                                      std::int64_t vocab, std::int64_t n, const float* __restrict__ row_max,
                                      const float* __restrict__ row_sum, const float* __restrict__ target,
                                      float* __restrict__ lse, Result* __restrict__ result) {
  double total = 0.0;
  float valid = 0.f, bad = 0.f;  // exact up to 2^24 rows per thread: far beyond N / 1024
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const std::int32_t t = targets[i];
    if (is_valid(t, ignore, vocab)) {
      const float z = row_max[i] + logf(row_sum[i]);
      lse[i] = z;
      total += static_cast<double>(z) - target[i];
      valid += 1.f;
    } else {
      lse[i] = 0.f;
      if (t != ignore) bad += 1.f;
    }
  }
  total = block_reduce<kFinalThreads>(total, Sum<double>{}, 0.0);
  const int nvalid = static_cast<int>(block_reduce<kFinalThreads>(static_cast<double>(valid), Sum<double>{}, 0.0));
  const int nbad = static_cast<int>(block_reduce<kFinalThreads>(static_cast<double>(bad), Sum<double>{}, 0.0));
  if (threadIdx.x == 0) {
    result->loss = nvalid > 0 ? static_cast<float>(total / nvalid) : 0.f;
    result->valid = nvalid;
    result->bad_targets = nbad;
  }
}

// A slice's part of the forward: [lse_r | target logit] per row (0 | 0 on rows that do not
// count; lse_r = -inf on an empty slice).
__global__ void finish_slice_kernel(const std::int32_t* __restrict__ targets, std::int32_t ignore, std::int64_t vocab,
                                    std::int64_t n, const float* __restrict__ row_max,
                                    const float* __restrict__ row_sum, const float* __restrict__ target,
                                    float* __restrict__ part) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const bool valid = is_valid(targets[i], ignore, vocab);
  part[i] = valid ? row_max[i] + logf(row_sum[i]) : 0.f;
  part[n + i] = valid ? target[i] : 0.f;
}

// The ranks' parts [ranks][2N] -> lse and the Result, as finish_forward_kernel: per row the
// log-sum-exp of the ranks' lse_r (max over ranks, then the sum of exp(lse_r - max) in rank
// order, in double) and the sum of their target logits (one non-zero) in rank order; then the
// same fixed-order block reductions. Every rank runs it on the same gathered parts and gets
// the same bits.
__global__ void __launch_bounds__(kFinalThreads) combine_kernel(const float* __restrict__ parts, std::int64_t ranks,
                               const std::int32_t* __restrict__ targets, std::int32_t ignore, std::int64_t vocab,
                               std::int64_t n, float* __restrict__ lse, Result* __restrict__ result) {
  double total = 0.0;
  float valid = 0.f, bad = 0.f;  // exact up to 2^24 rows per thread: far beyond N / 1024
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const std::int32_t t = targets[i];
    if (is_valid(t, ignore, vocab)) {
      float m = -INFINITY;
      for (std::int64_t r = 0; r < ranks; ++r) m = fmaxf(m, parts[r * 2 * n + i]);
      double sum = 0.0, tl = 0.0;
      for (std::int64_t r = 0; r < ranks; ++r) {
        sum += exp(static_cast<double>(parts[r * 2 * n + i]) - m);  // exp(-inf) = 0: an empty slice
        tl += parts[r * 2 * n + n + i];
      }
      const float z = static_cast<float>(m + log(sum));
      lse[i] = z;
      total += static_cast<double>(z) - tl;
      valid += 1.f;
    } else {
      lse[i] = 0.f;
      if (t != ignore) bad += 1.f;
    }
  }
  total = block_reduce<kFinalThreads>(total, Sum<double>{}, 0.0);
  const int nvalid = static_cast<int>(block_reduce<kFinalThreads>(static_cast<double>(valid), Sum<double>{}, 0.0));
  const int nbad = static_cast<int>(block_reduce<kFinalThreads>(static_cast<double>(bad), Sum<double>{}, 0.0));
  if (threadIdx.x == 0) {
    result->loss = nvalid > 0 ? static_cast<float>(total / nvalid) : 0.f;
    result->valid = nvalid;
    result->bad_targets = nbad;
  }
}

__global__ void __launch_bounds__(kFinalThreads) count_valid_kernel(const std::int32_t* __restrict__ targets, std::int32_t ignore, std::int64_t vocab,
                                   std::int64_t n, int* __restrict__ valid) {
  double c = 0.0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) c += is_valid(targets[i], ignore, vocab) ? 1.0 : 0.0;
  c = block_reduce<kFinalThreads>(c, Sum<double>{}, 0.0);
  if (threadIdx.x == 0) *valid = static_cast<int>(c);
}

// dlogits[i, j] = (exp(l - lse_i) - [j == t_i]) * dloss / n_valid, 0 on ignored rows. Rows at
// stride ld in both; with kept bf16 logits, dlogits overwrites them in place (each element is
// read, then written, by the same thread), so neither pointer is __restrict__. kVec: both
// blocks' rows 16-byte aligned (8-byte for 4 bf16 of an fp32 chunk).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads) dlogits_kernel(const T* logits, std::int64_t ld,
                                                              const std::int32_t* __restrict__ targets,
                                                              std::int32_t ignore, std::int64_t vocab, std::int64_t v0,
                                                              std::int64_t cs, const float* __restrict__ lse,
                                                              float dloss, const int* __restrict__ valid,
                                                              bf16* dlogits) {
  const std::int64_t i = blockIdx.x;
  const std::int32_t t = targets[i];
  const T* l = logits + i * ld;
  bf16* g = dlogits + i * ld;
  constexpr int kN = kVecElems<T>;
  const bool row_valid = is_valid(t, ignore, vocab);
  // exp(l - z) = exp2(l log2e - z log2e): one fma and one SFU exp2 per element.
  const float scale = row_valid ? dloss / static_cast<float>(*valid) : 0.f;  // valid >= 1 when this row counts
  const float zs = row_valid ? lse[i] * kLog2e : 0.f;
  const std::int64_t tj = row_valid ? t - v0 : -1;  // the target's column in this chunk, if it is here
  auto value = [&](float x, std::int64_t j) {
    if (!row_valid) return 0.f;
    float v = exp2f(fmaf(x, kLog2e, -zs)) * scale;
    if (j == tj) v -= scale;
    return v;
  };
  std::int64_t tail = 0;
  if constexpr (kVec) {
    const std::int64_t nvec = cs / kN;
    for (std::int64_t q = threadIdx.x; q < nvec; q += kRowThreads) {
      float x[kN];
      load_vec(l + q * kN, x);
#pragma unroll
      for (int k = 0; k < kN; ++k) x[k] = value(x[k], q * kN + k);
      store_bf16<kN>(g + q * kN, x);
    }
    tail = nvec * kN;
  }
  for (std::int64_t j = tail + threadIdx.x; j < cs; j += kRowThreads)
    g[j] = __float2bfloat16(value(static_cast<float>(l[j]), j));
}

__global__ void to_bf16_kernel(const float* __restrict__ in, bf16* __restrict__ out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}

template <typename T>
void launch_online_lse(const T* logits, std::int64_t ld, const std::int32_t* targets, std::int32_t ignore,
                       std::int64_t vocab, std::int64_t v0, std::int64_t cs, std::int64_t n, const Scratch& s,
                       cudaStream_t stream) {
  if (rows_vectorizable<T>(logits, ld))
    online_lse_kernel<T, true><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
        logits, ld, targets, ignore, vocab, v0, cs, s.row_max, s.row_sum, s.target);
  else
    online_lse_kernel<T, false><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
        logits, ld, targets, ignore, vocab, v0, cs, s.row_max, s.row_sum, s.target);
  KEEL_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_dlogits(const T* logits, std::int64_t ld, const std::int32_t* targets, std::int32_t ignore,
                    std::int64_t vocab, std::int64_t v0, std::int64_t cs, std::int64_t n, const float* lse, float dloss,
                    const int* valid, bf16* dlogits, cudaStream_t stream) {
  if (rows_vectorizable<T>(logits, ld) && rows_vectorizable<T>(dlogits, ld))
    dlogits_kernel<T, true><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(logits, ld, targets, ignore, vocab,
                                                                                 v0, cs, lse, dloss, valid, dlogits);
  else
    dlogits_kernel<T, false><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(logits, ld, targets, ignore, vocab,
                                                                                  v0, cs, lse, dloss, valid, dlogits);
  KEEL_CUDA_CHECK_LAUNCH();
}

void check(std::int64_t n, std::int64_t d, std::int64_t v, const Options& o) {
  if (n < 0 || d < 1 || v < 1) fail("cuda cross_entropy: need tokens >= 0, d >= 1, vocab >= 1; got {}, {}, {}", n, d, v);
  if (o.chunk < 1) fail("cuda cross_entropy: chunk must be >= 1, got {}", o.chunk);
  if (v > INT32_MAX) fail("cuda cross_entropy: vocabulary {} exceeds int32 targets", v);
}

GemmDesc desc(std::int64_t m, std::int64_t n, std::int64_t k, bool trans_a, bool trans_b, float beta,
              GemmOut c_type = GemmOut::kFp32) {
  GemmDesc g;
  g.m = m, g.n = n, g.k = k;
  g.trans_a = trans_a, g.trans_b = trans_b;
  g.c_type = c_type;
  g.beta = beta;
  return g;
}

void check_slice(std::int64_t n, std::int64_t d, const Slice& sl, const Options& o) {
  if (n < 0 || d < 1) fail("cuda cross_entropy slice: need tokens >= 0 and d >= 1; got {}, {}", n, d);
  if (sl.vocab < 1 || sl.begin < 0 || sl.rows < 0 || sl.begin + sl.rows > sl.vocab)
    fail("cuda cross_entropy slice: rows [{}, {}) are not a slice of the vocabulary of {}", sl.begin,
         sl.begin + sl.rows, sl.vocab);
  if (o.chunk < 1) fail("cuda cross_entropy: chunk must be >= 1, got {}", o.chunk);
  if (sl.vocab > INT32_MAX) fail("cuda cross_entropy: vocabulary {} exceeds int32 targets", sl.vocab);
}

// The statistics pass shared by both modes: rows [0, rows) of w are the vocabulary ids
// [begin, begin + rows) of a vocabulary of `vocab` (the whole head: 0, V, V). Per row of a
// valid target, the running max and sum over those columns and the target logit when the
// target is one of them (s.row_max, s.row_sum, s.target; initialized here). With keep_logits
// the bf16 [N, rows] logits stay in s.dlogits for backward.
void row_stats(const bf16* hidden, const bf16* w, const std::int32_t* targets, std::int64_t n, std::int64_t d,
               std::int64_t begin, std::int64_t rows, std::int64_t vocab, const Options& o, const Scratch& s,
               cudaStream_t stream) {
  init_rows_kernel<<<grid_for(n, 256), 256, 0, stream>>>(s.row_max, s.row_sum, s.target, n);
  KEEL_CUDA_CHECK_LAUNCH();
  if (rows == 0) return;
  GemmRunner& gemm = thread_gemm();
  if (o.keep_logits) {
    // One GEMM for all the columns: logits [N, rows] = hidden W^T in bf16 (as autocast keeps
    // them), kept for backward; the row statistics read the bf16 values backward will use.
    gemm.run(desc(n, rows, d, false, true, 0.f, GemmOut::kBf16), hidden, w, s.dlogits, stream);
    launch_online_lse<bf16>(s.dlogits, rows, targets, o.ignore_index, vocab, begin, rows, n, s, stream);
  } else {
    const std::int64_t c = std::min(o.chunk, rows);
    for (std::int64_t c0 = 0; c0 < rows; c0 += c) {
      const std::int64_t cs = std::min(c, rows - c0);
      // logits [N, cs] = hidden [N, D] W[c0 : c0 + cs]^T; column j is vocabulary id begin + c0 + j
      gemm.run(desc(n, cs, d, false, true, 0.f), hidden, w + c0 * d, s.logits, stream);
      launch_online_lse<float>(s.logits, cs, targets, o.ignore_index, vocab, begin + c0, cs, n, s, stream);
    }
  }
}

// The gradient pass shared by both modes (columns as in row_stats; rows >= 1): dlogits, then
// dh [N, D] fp32 = dlogits W (overwritten; null to skip) and dw [rows, D] (+)= dlogits^T hidden
// (null to skip). n_valid is counted on the device over the whole vocabulary's targets.
void grads(const bf16* hidden, const bf16* w, const std::int32_t* targets, const float* lse, float dloss,
           std::int64_t n, std::int64_t d, std::int64_t begin, std::int64_t rows, std::int64_t vocab, const Options& o,
           const Scratch& s, float* dh, float* dw, cudaStream_t stream) {
  const float dw_beta = o.overwrite_dw ? 0.f : 1.f;  // every row of dw is written either way
  count_valid_kernel<<<1, kFinalThreads, 0, stream>>>(targets, o.ignore_index, vocab, n, s.valid);
  KEEL_CUDA_CHECK_LAUNCH();
  GemmRunner& gemm = thread_gemm();
  if (o.keep_logits) {
    // The kept logits become dlogits in place; then two GEMMs over all the columns.
    launch_dlogits<bf16>(s.dlogits, rows, targets, o.ignore_index, vocab, begin, rows, n, lse, dloss, s.valid,
                         s.dlogits, stream);
    if (dh) gemm.run(desc(n, d, rows, false, false, 0.f), s.dlogits, w, dh, stream);
    if (dw) gemm.run(desc(rows, d, n, true, false, dw_beta), s.dlogits, hidden, dw, stream);
  } else {
    const std::int64_t c = std::min(o.chunk, rows);
    for (std::int64_t c0 = 0; c0 < rows; c0 += c) {
      const std::int64_t cs = std::min(c, rows - c0);
      gemm.run(desc(n, cs, d, false, true, 0.f), hidden, w + c0 * d, s.logits, stream);
      launch_dlogits<float>(s.logits, cs, targets, o.ignore_index, vocab, begin + c0, cs, n, lse, dloss, s.valid,
                            s.dlogits, stream);
      // dh [N, D] (+)= dlogits [N, cs] W_c [cs, D]; the first chunk overwrites.
      if (dh) gemm.run(desc(n, d, cs, false, false, c0 == 0 ? 0.f : 1.f), s.dlogits, w + c0 * d, dh, stream);
      // dW_c [cs, D] += dlogits^T [cs, N] hidden [N, D] (= with overwrite_dw)
      if (dw) gemm.run(desc(cs, d, n, true, false, dw_beta), s.dlogits, hidden, dw + c0 * d, stream);
    }
  }
}

}  // namespace

std::int64_t scratch_bytes(std::int64_t tokens, std::int64_t d, std::int64_t vocab, const Options& o) {
  return carve(nullptr, tokens, d, vocab, o).bytes;
}

void forward(const bf16* hidden, const bf16* w, const std::int32_t* targets, std::int64_t n, std::int64_t d,
             std::int64_t v, const Options& o, float* lse, Result* result, void* scratch, cudaStream_t stream) {
  check(n, d, v, o);
  if (!result) fail("cuda cross_entropy: result must not be null");
  if (n == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(Result), stream));
    return;
  }
  if (!hidden || !w || !targets || !lse || !scratch) fail("cuda cross_entropy: forward got a null pointer");
  const Scratch s = carve(scratch, n, d, v, o).s;
  row_stats(hidden, w, targets, n, d, 0, v, v, o, s, stream);
  finish_forward_kernel<<<1, kFinalThreads, 0, stream>>>(targets, o.ignore_index, v, n, s.row_max, s.row_sum, s.target,
                                                         lse, result);
  KEEL_CUDA_CHECK_LAUNCH();
}

Result read_result(const Result* result, cudaStream_t stream) {
  Result h{};
  KEEL_CUDA_CHECK(cudaMemcpyAsync(&h, result, sizeof(Result), cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(keel::stream_sync(stream));
  if (h.bad_targets > 0)
    fail("cuda cross_entropy: {} targets outside the vocabulary (and not the ignore index) were skipped", h.bad_targets);
  return h;
}

void backward(const bf16* hidden, const bf16* w, const std::int32_t* targets, const float* lse, float dloss,
              std::int64_t n, std::int64_t d, std::int64_t v, const Options& o, void* scratch, bf16* dhidden, float* dw,
              cudaStream_t stream) {
  check(n, d, v, o);
  if (n == 0 && dw && o.overwrite_dw)
    KEEL_CUDA_CHECK(cudaMemsetAsync(dw, 0, static_cast<std::size_t>(v * d) * sizeof(float), stream));
  if (n == 0 || (!dhidden && !dw)) return;
  if (!hidden || !w || !targets || !lse || !scratch) fail("cuda cross_entropy: backward got a null pointer");
  const Scratch s = carve(scratch, n, d, v, o).s;
  grads(hidden, w, targets, lse, dloss, n, d, 0, v, v, o, s, dhidden ? s.dhidden : nullptr, dw, stream);
  if (dhidden) {
    const std::int64_t total = n * d;
    const std::int64_t blocks = std::min<std::int64_t>((total + 255) / 256, 132 * 16);
    to_bf16_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(s.dhidden, dhidden, total);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

std::int64_t slice_scratch_bytes(std::int64_t tokens, std::int64_t vocab_local, const Options& o) {
  return carve_slice(nullptr, tokens, vocab_local, o).bytes;
}

void slice_forward(const bf16* hidden, const bf16* w_local, const std::int32_t* targets, std::int64_t n,
                   std::int64_t d, const Slice& slice, const Options& o, float* part, void* scratch,
                   cudaStream_t stream) {
  check_slice(n, d, slice, o);
  if (n == 0) return;
  if (!hidden || !targets || !part || !scratch || (slice.rows > 0 && !w_local))
    fail("cuda cross_entropy: slice_forward got a null pointer");
  const Scratch s = carve_slice(scratch, n, slice.rows, o).s;
  row_stats(hidden, w_local, targets, n, d, slice.begin, slice.rows, slice.vocab, o, s, stream);
  finish_slice_kernel<<<grid_for(n, 256), 256, 0, stream>>>(targets, o.ignore_index, slice.vocab, n, s.row_max,
                                                            s.row_sum, s.target, part);
  KEEL_CUDA_CHECK_LAUNCH();
}

void combine(const float* parts, std::int64_t ranks, const std::int32_t* targets, std::int64_t n, std::int64_t vocab,
             const Options& o, float* lse, Result* result, cudaStream_t stream) {
  if (n < 0 || ranks < 1 || vocab < 1 || vocab > INT32_MAX)
    fail("cuda cross_entropy combine: need tokens >= 0, ranks >= 1 and 1 <= vocab <= 2^31 - 1; got {}, {}, {}", n,
         ranks, vocab);
  if (!result) fail("cuda cross_entropy: result must not be null");
  if (n == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(Result), stream));
    return;
  }
  if (!parts || !targets || !lse) fail("cuda cross_entropy: combine got a null pointer");
  combine_kernel<<<1, kFinalThreads, 0, stream>>>(parts, ranks, targets, o.ignore_index, vocab, n, lse, result);
  KEEL_CUDA_CHECK_LAUNCH();
}

void slice_backward(const bf16* hidden, const bf16* w_local, const std::int32_t* targets, const float* lse, float dloss,
                    std::int64_t n, std::int64_t d, const Slice& slice, const Options& o, void* scratch,
                    float* dhidden_f32, float* dw_local, cudaStream_t stream) {
  check_slice(n, d, slice, o);
  if (n == 0 && dw_local && o.overwrite_dw && slice.rows > 0)
    KEEL_CUDA_CHECK(cudaMemsetAsync(dw_local, 0, static_cast<std::size_t>(slice.rows * d) * sizeof(float), stream));
  if (n == 0 || (!dhidden_f32 && !dw_local)) return;
  if (slice.rows == 0) {  // no columns: a zero share of dhidden, no dw rows
    if (dhidden_f32)
      KEEL_CUDA_CHECK(cudaMemsetAsync(dhidden_f32, 0, static_cast<std::size_t>(n * d) * sizeof(float), stream));
    return;
  }
  if (!hidden || !w_local || !targets || !lse || !scratch) fail("cuda cross_entropy: slice_backward got a null pointer");
  const Scratch s = carve_slice(scratch, n, slice.rows, o).s;
  grads(hidden, w_local, targets, lse, dloss, n, d, slice.begin, slice.rows, slice.vocab, o, s, dhidden_f32, dw_local,
        stream);
}

}  // namespace keel::ops::cuda::cross_entropy

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

__device__ inline bool is_valid(std::int32_t t, std::int32_t ignore, std::int64_t vocab) {
  return t != ignore && t >= 0 && t < vocab;
}

template <typename T>
struct Sum {
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
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

// Folds chunk [v0, v0 + cs) of row blockIdx.x into the running (max, sum) of that row. The
// chunk's logits are row i at logits + i * ld (fp32 chunk scratch, or the kept bf16 [N, V]).
template <typename T>
__global__ void online_lse_kernel(const T* __restrict__ logits, std::int64_t ld,
                                  const std::int32_t* __restrict__ targets, std::int32_t ignore, std::int64_t vocab,
                                  std::int64_t v0, std::int64_t cs, float* __restrict__ row_max,
                                  float* __restrict__ row_sum, float* __restrict__ target) {
  const std::int64_t i = blockIdx.x;
  const std::int32_t t = targets[i];
  if (!is_valid(t, ignore, vocab)) return;  // uniform over the block
  const T* l = logits + i * ld;
  float cm = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < cs; j += blockDim.x) cm = fmaxf(cm, static_cast<float>(l[j]));
  cm = block_reduce<kRowThreads>(cm, Max{}, -INFINITY);
  const float old_max = row_max[i];
  const float nm = fmaxf(old_max, cm);
  float acc = 0.f;
  for (std::int64_t j = threadIdx.x; j < cs; j += blockDim.x) acc += expf(static_cast<float>(l[j]) - nm);
  acc = block_reduce<kRowThreads>(acc, Sum<float>{}, 0.f);
  if (threadIdx.x == 0) {
    row_sum[i] = row_sum[i] * expf(old_max - nm) + acc;  // exp(-inf) = 0 on the first chunk
    row_max[i] = nm;
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

__global__ void count_valid_kernel(const std::int32_t* __restrict__ targets, std::int32_t ignore, std::int64_t vocab,
                                   std::int64_t n, int* __restrict__ valid) {
  double c = 0.0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) c += is_valid(targets[i], ignore, vocab) ? 1.0 : 0.0;
  c = block_reduce<kFinalThreads>(c, Sum<double>{}, 0.0);
  if (threadIdx.x == 0) *valid = static_cast<int>(c);
}

// dlogits[i, j] = (exp(l - lse_i) - [j == t_i]) * dloss / n_valid, 0 on ignored rows. Rows at
// stride ld in both; with kept bf16 logits, dlogits overwrites them in place (each element is
// read, then written, by the same thread), so neither pointer is __restrict__.
template <typename T>
__global__ void dlogits_kernel(const T* logits, std::int64_t ld, const std::int32_t* __restrict__ targets,
                               std::int32_t ignore, std::int64_t vocab, std::int64_t v0, std::int64_t cs,
                               const float* __restrict__ lse, float dloss, const int* __restrict__ valid,
                               bf16* dlogits) {
  const std::int64_t i = blockIdx.x;
  const std::int32_t t = targets[i];
  const T* l = logits + i * ld;
  bf16* g = dlogits + i * ld;
  if (!is_valid(t, ignore, vocab)) {
    for (std::int64_t j = threadIdx.x; j < cs; j += blockDim.x) g[j] = __float2bfloat16(0.f);
    return;
  }
  const float scale = dloss / static_cast<float>(*valid);  // valid >= 1: this row counts
  const float z = lse[i];
  const std::int64_t tj = t - v0;  // the target's column in this chunk, if it is here
  for (std::int64_t j = threadIdx.x; j < cs; j += blockDim.x) {
    float v = expf(static_cast<float>(l[j]) - z) * scale;
    if (j == tj) v -= scale;
    g[j] = __float2bfloat16(v);
  }
}

__global__ void to_bf16_kernel(const float* __restrict__ in, bf16* __restrict__ out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
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
  const std::int64_t c = std::min(o.chunk, v);
  const Scratch s = carve(scratch, n, d, v, o).s;
  init_rows_kernel<<<grid_for(n, 256), 256, 0, stream>>>(s.row_max, s.row_sum, s.target, n);
  KEEL_CUDA_CHECK_LAUNCH();
  GemmRunner& gemm = thread_gemm();
  if (o.keep_logits) {
    // One GEMM for the whole vocabulary: logits [N, V] = hidden W^T in bf16 (as autocast keeps
    // them), kept for backward; the row statistics read the bf16 values backward will use.
    gemm.run(desc(n, v, d, false, true, 0.f, GemmOut::kBf16), hidden, w, s.dlogits, stream);
    online_lse_kernel<bf16><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
        s.dlogits, v, targets, o.ignore_index, v, 0, v, s.row_max, s.row_sum, s.target);
    KEEL_CUDA_CHECK_LAUNCH();
  } else {
    for (std::int64_t v0 = 0; v0 < v; v0 += c) {
      const std::int64_t cs = std::min(c, v - v0);
      // logits [N, cs] = hidden [N, D] W[v0 : v0 + cs]^T
      gemm.run(desc(n, cs, d, false, true, 0.f), hidden, w + v0 * d, s.logits, stream);
      online_lse_kernel<float><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
          s.logits, cs, targets, o.ignore_index, v, v0, cs, s.row_max, s.row_sum, s.target);
      KEEL_CUDA_CHECK_LAUNCH();
    }
  }
  finish_forward_kernel<<<1, kFinalThreads, 0, stream>>>(targets, o.ignore_index, v, n, s.row_max, s.row_sum, s.target,
                                                         lse, result);
  KEEL_CUDA_CHECK_LAUNCH();
}

Result read_result(const Result* result, cudaStream_t stream) {
  Result h{};
  KEEL_CUDA_CHECK(cudaMemcpyAsync(&h, result, sizeof(Result), cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (h.bad_targets > 0)
    fail("cuda cross_entropy: {} targets outside the vocabulary (and not the ignore index) were skipped", h.bad_targets);
  return h;
}

void backward(const bf16* hidden, const bf16* w, const std::int32_t* targets, const float* lse, float dloss,
              std::int64_t n, std::int64_t d, std::int64_t v, const Options& o, void* scratch, bf16* dhidden, float* dw,
              cudaStream_t stream) {
  check(n, d, v, o);
  if (n == 0 || (!dhidden && !dw)) return;
  if (!hidden || !w || !targets || !lse || !scratch) fail("cuda cross_entropy: backward got a null pointer");
  const std::int64_t c = std::min(o.chunk, v);
  const Scratch s = carve(scratch, n, d, v, o).s;
  count_valid_kernel<<<1, kFinalThreads, 0, stream>>>(targets, o.ignore_index, v, n, s.valid);
  KEEL_CUDA_CHECK_LAUNCH();
  GemmRunner& gemm = thread_gemm();
  if (o.keep_logits) {
    // The kept logits become dlogits in place; then two whole-vocabulary GEMMs.
    dlogits_kernel<bf16><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
        s.dlogits, v, targets, o.ignore_index, v, 0, v, lse, dloss, s.valid, s.dlogits);
    KEEL_CUDA_CHECK_LAUNCH();
    if (dhidden) gemm.run(desc(n, d, v, false, false, 0.f), s.dlogits, w, s.dhidden, stream);
    if (dw) gemm.run(desc(v, d, n, true, false, 1.f), s.dlogits, hidden, dw, stream);
  } else {
    for (std::int64_t v0 = 0; v0 < v; v0 += c) {
      const std::int64_t cs = std::min(c, v - v0);
      gemm.run(desc(n, cs, d, false, true, 0.f), hidden, w + v0 * d, s.logits, stream);
      dlogits_kernel<float><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
          s.logits, cs, targets, o.ignore_index, v, v0, cs, lse, dloss, s.valid, s.dlogits);
      KEEL_CUDA_CHECK_LAUNCH();
      // dhidden [N, D] (+)= dlogits [N, cs] W_c [cs, D]; the first chunk overwrites.
      if (dhidden)
        gemm.run(desc(n, d, cs, false, false, v0 == 0 ? 0.f : 1.f), s.dlogits, w + v0 * d, s.dhidden, stream);
      // dW_c [cs, D] += dlogits^T [cs, N] hidden [N, D]
      if (dw) gemm.run(desc(cs, d, n, true, false, 1.f), s.dlogits, hidden, dw + v0 * d, stream);
    }
  }
  if (dhidden) {
    const std::int64_t total = n * d;
    const std::int64_t blocks = std::min<std::int64_t>((total + 255) / 256, 132 * 16);
    to_bf16_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(s.dhidden, dhidden, total);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace keel::ops::cuda::cross_entropy

// The GEMM seam of the CUDA ops: bf16 x bf16 -> bf16 or fp32 with fp32 accumulation, through
// cuBLASLt. Every matmul of the GPU training path (linear layers, expert blocks, the LM head)
// goes through here, so a HIP port swaps this one file for hipBLASLt.
//
// Row-major convention (the one src/ops uses): C[m, n] = alpha * op(A) op(B) + beta * C with
// op(A) [m, k] and op(B) [k, n]. A is stored [m, k] (trans_a = false) or [k, m] (true); B is
// stored [k, n] (trans_b = false) or [n, k] (true). Leading dimensions default to the tight
// row length of the stored matrix (0 = tight). batch > 1: `batch` independent GEMMs at the
// given element strides; inputs may be shared (stride 0) or interleaved, outputs must not
// overlap: each wholly past the previous one, or side by side as column blocks of the same rows
// (stride_c >= n and the last block within ldc: per-head GEMMs of a grouped layer).
//
// The three GEMMs of a linear layer y = x W^T (W [out, in], x [N, in]):
//   forward   y[N, out]   = x W^T        m=N,   n=out, k=in,  trans_b
//   dgrad     dx[N, in]   = dy W         m=N,   n=in,  k=out
//   wgrad     dW[out, in] += dy^T x      m=out, n=in,  k=N,   trans_a, fp32 C, beta = 1
//
// Algorithm choice: cuBLASLt's first heuristic candidate, per operand alignment (a sub-matrix
// view may start off a 16-byte boundary, and the algorithm must tolerate it) and per bucket of
// m and k (MoE expert GEMMs see a new row count nearly every step: shapes in one bucket reuse
// the first one's algorithm once cublasLtMatmulAlgoCheck accepts it for the exact shape), so
// the heuristic query runs once per bucket, and the descriptors once per exact shape. A
// GemmRunner owns a cuBLASLt handle and a workspace on the device current at construction;
// not thread-safe (one per thread/stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "ops/cuda/common.h"

namespace keel::ops::cuda {

enum class GemmOut { kBf16, kFp32 };

struct GemmDesc {
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  GemmOut c_type = GemmOut::kBf16;
  float alpha = 1.f, beta = 0.f;
  std::int64_t lda = 0, ldb = 0, ldc = 0;  // 0: tight
  int batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements; 0 with batch 1
};

class GemmRunner {
 public:
  explicit GemmRunner(std::size_t workspace_bytes = 32u << 20);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // C = alpha op(A) op(B) + beta C. Throws keel::Error on a bad descriptor (m, n, k < 0, a
  // leading dimension shorter than the row) or when cuBLASLt has no algorithm for it.
  // m, n or k == 0 is allowed: with k == 0 C is scaled by beta; with m or n == 0 nothing runs.
  void run(const GemmDesc& d, const bf16* a, const bf16* b, void* c, cudaStream_t stream);
  // C = alpha op(A) op(B) + beta C_in: the addend read from c_in (C's type, ldc and stride_c),
  // the result written to c. c_in is c itself or a buffer that does not overlap it (cuBLASLt's
  // separate C and D). Not with k == 0 unless c_in == c.
  void run(const GemmDesc& d, const bf16* a, const bf16* b, const void* c_in, void* c, cudaStream_t stream);

  // Distinct GEMM plans (descriptor + heuristic algorithm) cached so far; tests use it to see
  // that a repeated shape reuses its plan.
  std::size_t cached_plans() const;
  // Algorithm choices cached: shapes whose m and k fall in the same bucket (rounded up to a
  // quarter of their power of two) share one heuristic query, checked per exact shape.
  std::size_t cached_algorithms() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One runner per thread and device: the runner of the device current at the call, created on
// that thread's first call for that device.
GemmRunner& thread_gemm();

}  // namespace keel::ops::cuda

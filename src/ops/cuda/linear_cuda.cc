#include "ops/cuda/linear.h"

#include "common/error.h"

namespace keel::ops::cuda::linear {

namespace {

void check_extents(std::int64_t n, std::int64_t in, std::int64_t out, const char* what) {
  if (n < 0 || in < 0 || out < 0) fail("cuda linear {}: extents must be >= 0, got n={} in={} out={}", what, n, in, out);
}

// y [n, out] = x [n, in] W^T: W [out, in] is op(B) stored transposed.
void forward_gemm(GemmRunner& gemm, const bf16* x, const bf16* w, void* y, GemmOut y_type, std::int64_t n,
                  std::int64_t in, std::int64_t out, cudaStream_t stream) {
  check_extents(n, in, out, "forward");
  GemmDesc d;
  d.m = n, d.n = out, d.k = in;
  d.trans_b = true;
  d.c_type = y_type;
  gemm.run(d, x, w, y, stream);
}

}  // namespace

void forward(GemmRunner& gemm, const bf16* x, const bf16* w, bf16* y, std::int64_t n, std::int64_t in,
             std::int64_t out, cudaStream_t stream) {
  forward_gemm(gemm, x, w, y, GemmOut::kBf16, n, in, out, stream);
}

void forward_f32(GemmRunner& gemm, const bf16* x, const bf16* w, float* y, std::int64_t n, std::int64_t in,
                 std::int64_t out, cudaStream_t stream) {
  forward_gemm(gemm, x, w, y, GemmOut::kFp32, n, in, out, stream);
}

void backward(GemmRunner& gemm, const bf16* x, const bf16* w, const bf16* dy, bf16* dx, float* dw, std::int64_t n,
              std::int64_t in, std::int64_t out, cudaStream_t stream) {
  check_extents(n, in, out, "backward");
  if (dx != nullptr) {
    // dx [n, in] = dy [n, out] W [out, in]. With out == 0 the GEMM's k is 0 and beta 0 zeroes dx.
    GemmDesc d;
    d.m = n, d.n = in, d.k = out;
    gemm.run(d, dy, w, dx, stream);
  }
  if (dw != nullptr) {
    // dW [out, in] += dy^T x: dy [n, out] is op(A) stored transposed; fp32 C with beta 1 accumulates.
    GemmDesc d;
    d.m = out, d.n = in, d.k = n;
    d.trans_a = true;
    d.c_type = GemmOut::kFp32;
    d.beta = 1.f;
    gemm.run(d, dy, x, dw, stream);
  }
}

}  // namespace keel::ops::cuda::linear

#include "ops/linear.h"

#include <cblas.h>

#include "common/error.h"

namespace keel::ops::linear {

namespace {
void check(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y, const char* what) {
  if (x.ndim() != 2 || w.ndim() != 2) fail("linear {}: x and W must be 2-D, got {} and {}", what, x.shape_string(), w.shape_string());
  require_shape(w, {w.dim(0), x.dim(1)}, "linear W");
  require_shape(y, {x.dim(0), w.dim(0)}, "linear y/dy");
  if (!b.empty()) require_shape(b, {w.dim(0)}, "linear b");
}
}  // namespace

void forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  check(x, w, b, y, "forward");
  const int n = static_cast<int>(x.dim(0)), in = static_cast<int>(x.dim(1)), out = static_cast<int>(w.dim(0));
  if (n == 0 || out == 0) return;
  float beta = 0.f;
  if (!b.empty()) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < out; ++j) y.row(i)[j] = b[j];
    beta = 1.f;
  }
  // y[n, out] = x[n, in] * W^T[in, out]
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.f, x.data(), in, w.data(), in, beta, y.data(), out);
}

void backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
              const Tensor& db) {
  check(x, w, db, dy, "backward");
  const int n = static_cast<int>(x.dim(0)), in = static_cast<int>(x.dim(1)), out = static_cast<int>(w.dim(0));
  if (!dx.empty()) {
    require_shape(dx, {n, in}, "linear dx");
    if (out == 0) dx.zero();
    // dx[n, in] = dy[n, out] * W[out, in]
    else if (n > 0) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in, out, 1.f, dy.data(), out, w.data(), in, 0.f, dx.data(), in);
  }
  if (!dw.empty() && n > 0) {
    require_shape(dw, {out, in}, "linear dW");
    // dW[out, in] += dy^T[out, n] * x[n, in]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, n, 1.f, dy.data(), out, x.data(), in, 1.f, dw.data(), in);
  }
  if (!db.empty()) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < out; ++j) db[j] += dy.row(i)[j];
  }
}

}  // namespace keel::ops::linear

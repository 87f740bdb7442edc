#include "ops/rmsnorm.h"

#include <cmath>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::rmsnorm {

void forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd) {
  if (x.ndim() != 2) fail("rmsnorm: x must be [N, D], got {}", x.shape_string());
  const std::int64_t n = x.dim(0), d = x.dim(1);
  require_shape(w, {d}, "rmsnorm w");
  require_shape(y, {n, d}, "rmsnorm y");
  if (!rstd.empty()) require_shape(rstd, {n}, "rmsnorm rstd");
  parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const float* xr = x.row(i);
      float* yr = y.row(i);
      double ss = 0;  // double accumulation: the reference should not be the noisy side
      for (std::int64_t j = 0; j < d; ++j) ss += double(xr[j]) * xr[j];
      float r = static_cast<float>(1.0 / std::sqrt(ss / double(d) + double(eps)));
      for (std::int64_t j = 0; j < d; ++j) yr[j] = xr[j] * r * w[j];
      if (!rstd.empty()) rstd[i] = r;
    }
  });
}

void backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx, const Tensor& dw) {
  const std::int64_t n = x.dim(0), d = x.dim(1);
  require_shape(w, {d}, "rmsnorm w");
  require_shape(rstd, {n}, "rmsnorm rstd");
  require_shape(dy, {n, d}, "rmsnorm dy");
  if (!dx.empty()) {
    require_shape(dx, {n, d}, "rmsnorm dx");
    parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        const float* xr = x.row(i);
        const float* dyr = dy.row(i);
        float* dxr = dx.row(i);
        const float r = rstd[i];
        double dot = 0;  // sum_d (dy * w) * xhat
        for (std::int64_t j = 0; j < d; ++j) dot += double(dyr[j]) * w[j] * xr[j] * r;
        const float m = static_cast<float>(dot / double(d));
        for (std::int64_t j = 0; j < d; ++j) dxr[j] += r * (dyr[j] * w[j] - xr[j] * r * m);  // accumulated
      }
    });
  }
  if (!dw.empty()) {
    require_shape(dw, {d}, "rmsnorm dw");
    // Parallel over channels so no two threads add into the same dw element.
    parallel_for(d, 256, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t j = b; j < e; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < n; ++i) acc += double(dy.row(i)[j]) * x.row(i)[j] * rstd[i];
        dw[j] += static_cast<float>(acc);
      }
    });
  }
}

}  // namespace keel::ops::rmsnorm

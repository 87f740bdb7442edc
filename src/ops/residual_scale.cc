#include "ops/residual_scale.h"

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::residual_scale {

namespace {
std::int64_t check(const Tensor& x, const Tensor& b, const Tensor& s, const char* what) {
  if (x.ndim() != 2) fail("residual_scale {}: expected [N, D], got {}", what, x.shape_string());
  require_shape(b, {x.dim(1)}, "residual_scale b");
  require_shape(s, {x.dim(1)}, "residual_scale s");
  return x.dim(1);
}
}  // namespace

void forward(const Tensor& x, const Tensor& b, const Tensor& s, const Tensor& y) {
  const std::int64_t d = check(x, b, s, "x");
  require_shape(y, {x.dim(0), d}, "residual_scale y");
  parallel_for(x.dim(0), 256, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      const float* xr = x.row(i);
      float* yr = y.row(i);
      for (std::int64_t j = 0; j < d; ++j) yr[j] = (xr[j] + b[j]) * s[j];
    }
  });
}

void backward(const Tensor& x, const Tensor& b, const Tensor& s, const Tensor& dy, const Tensor& dx, const Tensor& db,
              const Tensor& ds) {
  const std::int64_t d = check(x, b, s, "x"), n = x.dim(0);
  require_shape(dy, {n, d}, "residual_scale dy");
  // Parameter gradients first: dx may alias dy.
  if (!db.empty() || !ds.empty()) {
    if (!db.empty()) require_shape(db, {d}, "residual_scale db");
    if (!ds.empty()) require_shape(ds, {d}, "residual_scale ds");
    parallel_for(d, 256, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t j = lo; j < hi; ++j) {
        double gb = 0, gs = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          const double g = dy.row(i)[j];
          gb += g;
          gs += g * (double(x.row(i)[j]) + b[j]);
        }
        if (!db.empty()) db[j] += static_cast<float>(gb * s[j]);
        if (!ds.empty()) ds[j] += static_cast<float>(gs);
      }
    });
  }
  if (!dx.empty()) {
    require_shape(dx, {n, d}, "residual_scale dx");
    parallel_for(n, 256, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i)
        for (std::int64_t j = 0; j < d; ++j) dx.row(i)[j] = dy.row(i)[j] * s[j];
    });
  }
}

void merge_forward(const Tensor& r, const Tensor& h, const Tensor& b_r, const Tensor& s_r, const Tensor& b_h,
                   const Tensor& s_h, const Tensor& out) {
  const std::int64_t d = check(r, b_r, s_r, "r");
  check(h, b_h, s_h, "h");
  require_shape(h, {r.dim(0), d}, "residual_scale h");
  require_shape(out, {r.dim(0), d}, "residual_scale out");
  parallel_for(r.dim(0), 256, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      const float* rr = r.row(i);
      const float* hr = h.row(i);
      float* o = out.row(i);
      for (std::int64_t j = 0; j < d; ++j) o[j] = (rr[j] + b_r[j]) * s_r[j] + (hr[j] + b_h[j]) * s_h[j];
    }
  });
}

void merge_backward(const Tensor& r, const Tensor& h, const Tensor& b_r, const Tensor& s_r, const Tensor& b_h,
                    const Tensor& s_h, const Tensor& dout, const Tensor& dr, const Tensor& dh, const Tensor& db_r,
                    const Tensor& ds_r, const Tensor& db_h, const Tensor& ds_h) {
  require_shape(h, {r.dim(0), r.dim(1)}, "residual_scale h");
  // The h branch reads dout before the r branch may overwrite it through dr.
  backward(h, b_h, s_h, dout, dh, db_h, ds_h);
  backward(r, b_r, s_r, dout, dr, db_r, ds_r);
}

}  // namespace keel::ops::residual_scale

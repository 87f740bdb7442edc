#include "ops/rope.h"

#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::rope {

Table make_table(int head_dim, double rotary_fraction, double base, int max_positions) {
  Table t;
  t.head_dim = head_dim;
  t.rotary_dim = static_cast<int>(std::lround(rotary_fraction * head_dim));
  t.max_positions = max_positions;
  if (head_dim <= 0 || t.rotary_dim <= 0 || t.rotary_dim > head_dim || t.rotary_dim % 2)
    fail("rope: rotary_fraction {} of head_dim {} gives {} rotated channels; need an even number in (0, head_dim]",
         rotary_fraction, head_dim, t.rotary_dim);
  if (base <= 1.0) fail("rope: base must be > 1, got {}", base);
  if (max_positions <= 0) fail("rope: max_positions must be positive, got {}", max_positions);
  const int half = t.rotary_dim / 2;
  t.cos.resize(static_cast<std::size_t>(max_positions) * half);
  t.sin.resize(t.cos.size());
  for (int p = 0; p < max_positions; ++p)
    for (int i = 0; i < half; ++i) {
      double f = std::pow(base, -2.0 * i / t.rotary_dim);
      double a = p * f;
      t.cos[std::size_t(p) * half + i] = static_cast<float>(std::cos(a));
      t.sin[std::size_t(p) * half + i] = static_cast<float>(std::sin(a));
    }
  return t;
}

namespace {
// sign = +1: forward rotation; -1: inverse rotation.
void rotate(const Table& t, const Tensor& x, const std::int32_t* positions, const Tensor& y, float sign, const char* what) {
  if (x.ndim() != 3 || x.dim(2) != t.head_dim)
    fail("rope {}: expected [N, H, {}], got {}", what, t.head_dim, x.shape_string());
  const std::int64_t n = x.dim(0), h = x.dim(1), d = t.head_dim;
  require_shape(y, {n, h, d}, "rope output");
  for (std::int64_t i = 0; i < n; ++i)
    if (positions[i] < 0 || positions[i] >= t.max_positions)
      fail("rope {}: position {} of token {} outside the table's [0, {})", what, positions[i], i, t.max_positions);
  const int half = t.rotary_dim / 2;
  parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const float* c = t.cos.data() + std::size_t(positions[i]) * half;
      const float* s = t.sin.data() + std::size_t(positions[i]) * half;
      for (std::int64_t hh = 0; hh < h; ++hh) {
        const float* xr = x.data() + (i * h + hh) * d;
        float* yr = y.data() + (i * h + hh) * d;
        for (int k = 0; k < half; ++k) {
          const float a = xr[k], bb = xr[k + half], sk = sign * s[k];
          yr[k] = a * c[k] - bb * sk;
          yr[k + half] = bb * c[k] + a * sk;
        }
        if (yr != xr && d > t.rotary_dim) std::memcpy(yr + t.rotary_dim, xr + t.rotary_dim, sizeof(float) * (d - t.rotary_dim));
      }
    }
  });
}
}  // namespace

void forward(const Table& t, const Tensor& x, const std::int32_t* positions, const Tensor& y) {
  rotate(t, x, positions, y, 1.f, "forward");
}

void backward(const Table& t, const Tensor& dy, const std::int32_t* positions, const Tensor& dx) {
  rotate(t, dy, positions, dx, -1.f, "backward");
}

}  // namespace keel::ops::rope

#include "optim/newton_schulz.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "common/error.h"

namespace keel::optim {

std::int64_t newton_schulz_scratch_floats(std::int64_t rows, std::int64_t cols) {
  std::int64_t s = std::min(rows, cols), l = std::max(rows, cols);
  return 2 * s * l + 2 * s * s;
}

double newton_schulz_flops(std::int64_t rows, std::int64_t cols, int steps) {
  double s = static_cast<double>(std::min(rows, cols)), l = static_cast<double>(std::max(rows, cols));
  return steps * (4.0 * s * s * l + 2.0 * s * s * s);
}

void newton_schulz(const float* g, float* out, std::int64_t rows, std::int64_t cols, float* scratch, int steps,
                   const NsCoefficients& k, float eps) {
  if (rows < 1 || cols < 1) fail("newton_schulz: matrix must be at least 1 x 1, got {} x {}", rows, cols);
  if (steps < 0) fail("newton_schulz: steps must be >= 0, got {}", steps);
  const bool tall = rows > cols;
  const std::int64_t s = tall ? cols : rows, l = tall ? rows : cols;  // X is s x l (wide)
  float* x = scratch;
  float* y = x + s * l;
  float* a = y + s * l;
  float* b = a + s * s;

  // X_0 = G (or G^T) / (||G||_F + eps), the norm accumulated in double.
  double sq = 0;
  for (std::int64_t i = 0; i < rows * cols; ++i) sq += static_cast<double>(g[i]) * g[i];
  const float inv = static_cast<float>(1.0 / (std::sqrt(sq) + eps));
  if (tall) {
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) x[j * l + i] = g[i * cols + j] * inv;
  } else {
    for (std::int64_t i = 0; i < s * l; ++i) x[i] = g[i] * inv;
  }

  const int S = static_cast<int>(s), L = static_cast<int>(l);
  const float ka = static_cast<float>(k.a), kb = static_cast<float>(k.b), kc = static_cast<float>(k.c);
  for (int it = 0; it < steps; ++it) {
    // A = X X^T  [s, s]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, S, S, L, 1.0f, x, L, x, L, 0.0f, a, S);
    // B = b A + c A A  [s, s]
    for (std::int64_t i = 0; i < s * s; ++i) b[i] = kb * a[i];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, S, S, S, kc, a, S, a, S, 1.0f, b, S);
    // Y = a X + B X  [s, l]
    for (std::int64_t i = 0; i < s * l; ++i) y[i] = ka * x[i];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, S, L, S, 1.0f, b, S, x, L, 1.0f, y, L);
    std::swap(x, y);
  }

  if (tall) {
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) out[i * cols + j] = x[j * l + i];
  } else {
    std::copy(x, x + s * l, out);
  }
}

}  // namespace keel::optim

// Shared helpers for the optimizer tests: seeded random data and double-precision references.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <random>
#include <utility>
#include <vector>

namespace keel::optim::testing {

// "1.234e-07", for RecordProperty (std::to_string keeps only 6 decimals).
inline std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", x);
  return buf;
}

inline std::vector<float> randn(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// C [m, n] = A [m, k] * B [k, n], row-major, double.
inline std::vector<double> matmul(const std::vector<double>& a, const std::vector<double>& b, std::int64_t m,
                                  std::int64_t k, std::int64_t n) {
  std::vector<double> c(static_cast<std::size_t>(m * n), 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t p = 0; p < k; ++p) {
      double aip = a[i * k + p];
      for (std::int64_t j = 0; j < n; ++j) c[i * n + j] += aip * b[p * n + j];
    }
  return c;
}

inline std::vector<double> transpose(const std::vector<double>& a, std::int64_t m, std::int64_t n) {
  std::vector<double> t(a.size());
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) t[j * m + i] = a[i * n + j];
  return t;
}

// The same quintic Newton-Schulz iteration as optim/newton_schulz.h, in double, written
// independently (plain loops, no BLAS), including the tall-matrix transpose.
inline std::vector<double> newton_schulz_ref(std::vector<double> g, std::int64_t rows, std::int64_t cols, int steps,
                                             double a = 3.4445, double b = -4.7750, double c = 2.0315,
                                             double eps = 1e-7) {
  bool tall = rows > cols;
  std::int64_t s = tall ? cols : rows, l = tall ? rows : cols;
  std::vector<double> x = tall ? transpose(g, rows, cols) : g;
  double sq = 0;
  for (double v : x) sq += v * v;
  double inv = 1.0 / (std::sqrt(sq) + eps);
  for (double& v : x) v *= inv;
  for (int it = 0; it < steps; ++it) {
    auto A = matmul(x, transpose(x, s, l), s, l, s);
    auto AA = matmul(A, A, s, s, s);
    std::vector<double> B(A.size());
    for (std::size_t i = 0; i < B.size(); ++i) B[i] = b * A[i] + c * AA[i];
    auto BX = matmul(B, x, s, s, l);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = a * x[i] + BX[i];
  }
  return tall ? transpose(x, s, l) : x;
}

// Eigenvalues of a symmetric n x n matrix by cyclic Jacobi rotations (double).
inline std::vector<double> jacobi_eigenvalues(std::vector<double> a, std::int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (std::int64_t p = 0; p < n; ++p)
      for (std::int64_t q = p + 1; q < n; ++q) off += a[p * n + q] * a[p * n + q];
    if (off < 1e-30) break;
    for (std::int64_t p = 0; p < n; ++p)
      for (std::int64_t q = p + 1; q < n; ++q) {
        double apq = a[p * n + q];
        if (std::fabs(apq) < 1e-300) continue;
        double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (std::int64_t k = 0; k < n; ++k) {  // A J
          double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (std::int64_t k = 0; k < n; ++k) {  // J^T (A J)
          double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ev[i] = a[i * n + i];
  return ev;
}

// Singular values of an m x n matrix: sqrt of the eigenvalues of the smaller Gram matrix.
inline std::vector<double> singular_values(const std::vector<double>& x, std::int64_t m, std::int64_t n) {
  std::vector<double> gram = m <= n ? matmul(x, transpose(x, m, n), m, n, m) : matmul(transpose(x, m, n), x, n, m, n);
  auto ev = jacobi_eigenvalues(gram, std::min(m, n));
  for (double& e : ev) e = std::sqrt(std::max(0.0, e));
  return ev;
}

// The exact polar factor U V^T by the cubic Newton-Schulz iteration X <- 1.5 X - 0.5 X X^T X
// in double (converges for singular values in (0, sqrt 3); X_0 = G / ||G||_F), iterated to a
// fixed point. Works on the wide orientation.
inline std::vector<double> polar_ref(const std::vector<double>& g, std::int64_t rows, std::int64_t cols) {
  bool tall = rows > cols;
  std::int64_t s = tall ? cols : rows, l = tall ? rows : cols;
  std::vector<double> x = tall ? transpose(g, rows, cols) : g;
  double sq = 0;
  for (double v : x) sq += v * v;
  for (double& v : x) v /= std::sqrt(sq);
  for (int it = 0; it < 200; ++it) {
    auto A = matmul(x, transpose(x, s, l), s, l, s);
    auto AX = matmul(A, x, s, s, l);
    double change = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      double nx = 1.5 * x[i] - 0.5 * AX[i];
      change = std::max(change, std::fabs(nx - x[i]));
      x[i] = nx;
    }
    if (change < 1e-15) break;
  }
  return tall ? transpose(x, s, l) : x;
}

}  // namespace keel::optim::testing

// Finite-difference gradient checks for the CPU reference ops.
//
// Every op test reduces the op's outputs to a scalar loss L = sum_i out_i * r_i with a fixed
// random r (so every output element gets a distinct weight, and dL/dout = r is the upstream
// gradient given to backward), then compares the analytic gradient of each input and
// parameter with central differences (L(x + h) - L(x - h)) / 2h, h ~ 1e-3, in double.
// The error measure is relative on the whole gradient: ||num - ana|| / max(||num||, ||ana||).
// With fp32 forwards the noise floor is ~1e-4; the tolerance (1e-2) fails on real mistakes:
// OpGradCheck.DetectsBrokenGradient shows a gradient off by 2%, or with one sign flipped,
// failing it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "tensor/tensor.h"

namespace keel::test {

inline constexpr double kGradTol = 1e-2;

// Uniform in [-scale, scale], never exactly zero (|v| >= 0.05 * scale).
inline std::vector<float> random_vector(std::size_t n, std::uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.05f, 1.f);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> v(n);
  for (auto& x : v) x = (sign(rng) ? 1.f : -1.f) * u(rng) * scale;
  return v;
}

inline double weighted_sum(const float* out, const std::vector<float>& r) {
  double s = 0;
  for (std::size_t i = 0; i < r.size(); ++i) s += double(out[i]) * r[i];
  return s;
}

struct GradResult {
  double rel_err = 0, num_norm = 0, ana_norm = 0;
  std::int64_t checked = 0;
};

// Perturbs x[i] (up to max_elems of them, a fixed random subset beyond that) by +-eps,
// calling loss() each time, and compares with the analytic grad[i]. x is restored.
inline GradResult check_grad(const std::string& name, const std::function<double()>& loss, float* x, const float* grad,
                             std::int64_t n, double eps = 1e-3, std::int64_t max_elems = 400) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) idx[i] = i;
  if (n > max_elems) {
    std::mt19937 rng(1234);
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(static_cast<std::size_t>(max_elems));
  }
  double diff2 = 0, num2 = 0, ana2 = 0;
  for (std::int64_t i : idx) {
    const float x0 = x[i];
    const float xp = static_cast<float>(x0 + eps), xm = static_cast<float>(x0 - eps);
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = x0;
    // Divide by the step actually taken in fp32, not by the nominal 2 eps.
    const double num = (lp - lm) / (double(xp) - double(xm));
    const double ana = grad[i];
    diff2 += (num - ana) * (num - ana);
    num2 += num * num;
    ana2 += ana * ana;
  }
  GradResult r;
  r.num_norm = std::sqrt(num2);
  r.ana_norm = std::sqrt(ana2);
  r.rel_err = std::sqrt(diff2) / std::max({r.num_norm, r.ana_norm, 1e-12});
  r.checked = static_cast<std::int64_t>(idx.size());
  std::printf("[gradcheck] %-40s rel_err=%.3e  |grad|=%.3e  (%lld elements)\n", name.c_str(), r.rel_err, r.ana_norm,
              static_cast<long long>(r.checked));
  return r;
}

}  // namespace keel::test

#include "bench/gemm/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace keel::bench {

std::vector<std::array<std::int64_t, 3>> gemm_check_positions(const GemmShape& s, int count, std::uint64_t seed) {
  std::vector<std::array<std::int64_t, 3>> out;
  auto add = [&](std::int64_t b, std::int64_t i, std::int64_t j) {
    const std::array<std::int64_t, 3> p{b, i, j};
    if (static_cast<int>(out.size()) < count && std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  };
  for (std::int64_t b : {std::int64_t{0}, s.batch - 1}) {
    add(b, 0, 0);
    add(b, s.m - 1, s.n - 1);
    add(b, 0, s.n - 1);
    add(b, s.m - 1, 0);
  }
  std::mt19937_64 rng(seed);
  const double total = static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.batch);
  for (int tries = 0; static_cast<int>(out.size()) < count && static_cast<double>(out.size()) < total && tries < 100 * count;
       ++tries)
    add(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(s.batch)),
        static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(s.m)),
        static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(s.n)));
  return out;
}

double gemm_tolerance(GemmType t, std::int64_t k, double ref, double sum_abs, double sum_sq) {
  double u_out = 0x1p-24, u_in = 0, u_acc = 0x1p-24;
  switch (t) {
    // Unit roundoff of the output: bf16 keeps 8 significant bits, fp16 11.
    case GemmType::kBF16: u_out = 0x1p-8; break;
    case GemmType::kFP16: u_out = 0x1p-11; break;
    case GemmType::kFP8:
      u_out = 0x1p-8;    // bf16 output
      u_acc = 0x1p-14;   // Hopper fp8 tensor cores accumulate with fewer than fp32's bits
      break;
    case GemmType::kTF32: u_in = 0x1p-11; break;
    case GemmType::kFP32: break;
  }
  // Input rounding is bounded outright; accumulation errors of random-sign terms grow like
  // sqrt(k) (never counted below 16 terms' worth), with a factor 4 of headroom.
  const double acc_terms = std::max(16.0, std::sqrt(static_cast<double>(k)));
  // Split-k partials rounded to the output type (cuBLASLt's OUTPUT_TYPE reduction): each is a
  // random walk of its terms, so their rounding errors add up to about u_out x sqrt(sum_sq)
  // whatever the number of splits; 6 of those.
  const double split_k = 6 * u_out * std::sqrt(sum_sq);
  return 2 * u_out * std::fabs(ref) + 2 * u_in * sum_abs + 4 * acc_terms * u_acc * sum_abs + split_k + 1e-30;
}

GemmCheckOutcome check_gemm(const GemmResult& r, GemmType t, std::int64_t k) {
  GemmCheckOutcome out;
  for (const auto& s : r.samples) {
    double ref = 0, sum_abs = 0, sum_sq = 0;
    for (std::size_t q = 0; q < s.a.size() && q < s.b.size(); ++q) {
      const double p = static_cast<double>(s.a[q]) * static_cast<double>(s.b[q]);
      ref += p;
      sum_abs += std::fabs(p);
      sum_sq += p * p;
    }
    ref *= r.scale;
    sum_abs *= r.scale;
    sum_sq *= r.scale * r.scale;
    const double tol = gemm_tolerance(t, k, ref, sum_abs, sum_sq);
    const double err = std::fabs(s.got - ref);
    ++out.samples;
    const double ratio = std::isfinite(err) ? err / tol : INFINITY;
    out.worst_ratio = std::max(out.worst_ratio, ratio);
    if (!(err <= tol)) {
      if (out.wrong++ == 0)
        out.first_wrong = fmt::format("(batch {}, row {}, col {}): got {:.7g}, expected {:.7g}, tolerance {:.3g}",
                                      s.batch, s.i, s.j, s.got, ref, tol);
    }
  }
  return out;
}

}  // namespace keel::bench

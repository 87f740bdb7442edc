#include "ops/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::router {

Losses forward(const Tensor& logits, const Tensor& bias, const Options& o, const Tensor& probs, const Tensor& lse,
               std::int32_t* expert_idx, const Tensor& gates, std::int64_t* counts) {
  if (logits.ndim() != 2) fail("router: logits must be [N, E], got {}", logits.shape_string());
  const std::int64_t n = logits.dim(0), ne = logits.dim(1);
  const int k = o.top_k;
  if (k < 1 || k > ne) fail("router: top_k {} must be in [1, {}]", k, ne);
  const int forced = o.forced_classes;
  if (forced < 0 || forced > ne || (forced > 0 && k > forced))
    fail("router: forced_classes {} must be 0 or in [top_k {}, {} experts]", forced, k, ne);
  if (!bias.empty()) require_shape(bias, {ne}, "router bias");
  require_shape(probs, {n, ne}, "router probs");
  require_shape(lse, {n}, "router lse");
  require_shape(gates, {n, k}, "router gates");
  parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
    std::vector<int> order(static_cast<std::size_t>(ne));
    std::vector<float> score(static_cast<std::size_t>(ne));
    for (std::int64_t i = b; i < e; ++i) {
      const float* l = logits.row(i);
      float* p = probs.row(i);
      const float m = *std::max_element(l, l + ne);
      double s = 0;
      for (std::int64_t j = 0; j < ne; ++j) s += std::exp(double(l[j]) - m);
      const float lz = static_cast<float>(m + std::log(s));
      lse[i] = lz;
      for (std::int64_t j = 0; j < ne; ++j) {
        p[j] = std::exp(l[j] - lz);
        score[j] = p[j] + (bias.empty() ? 0.f : bias[j]);
      }
      if (forced > 0) {  // forced balance: the slot's class, whatever the scores
        for (int kk = 0; kk < k; ++kk) order[kk] = int((i * k + kk) % forced);
      } else {
        for (std::int64_t j = 0; j < ne; ++j) order[j] = int(j);
        // Best first; equal scores keep the lower index first (stable tie-break, CUDA must match).
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int c) {
          return score[a] > score[c] || (score[a] == score[c] && a < c);
        });
      }
      float norm = 1.f;
      if (o.renormalize) {
        float t = 0.f;
        for (int kk = 0; kk < k; ++kk) t += p[order[kk]];
        norm = 1.f / t;
      }
      for (int kk = 0; kk < k; ++kk) {
        expert_idx[i * k + kk] = order[kk];
        gates.row(i)[kk] = p[order[kk]] * norm;
      }
    }
  });
  std::fill(counts, counts + ne, 0);
  for (std::int64_t i = 0; i < n * k; ++i) ++counts[expert_idx[i]];
  Losses out;
  if (n == 0) return out;
  double z = 0;
  for (std::int64_t i = 0; i < n; ++i) z += double(lse[i]) * lse[i];
  out.aux = aux_loss(probs, counts, n, k);
  out.z = static_cast<float>(z / double(n));
  return out;
}

float aux_loss(const Tensor& probs, const std::int64_t* counts, std::int64_t count_rows, int top_k) {
  const std::int64_t n = probs.dim(0), ne = probs.dim(1);
  if (n == 0 || count_rows <= 0) return 0.f;
  double aux = 0;
  for (std::int64_t j = 0; j < ne; ++j) {
    double pm = 0;
    for (std::int64_t i = 0; i < n; ++i) pm += probs.row(i)[j];
    aux += double(counts[j]) / double(count_rows * top_k) * (pm / double(n));
  }
  return static_cast<float>(double(ne) * aux);
}

void backward(const Tensor& probs, const Tensor& lse, const std::int32_t* expert_idx, const Tensor& gates,
              const std::int64_t* counts, const Options& o, const Tensor& dgates, float d_aux, float d_z,
              const Tensor& dlogits, std::int64_t count_rows) {
  const std::int64_t n = probs.dim(0), ne = probs.dim(1);
  const int k = o.top_k;
  require_shape(lse, {n}, "router lse");
  require_shape(gates, {n, k}, "router gates");
  require_shape(dlogits, {n, ne}, "router dlogits");
  if (!dgates.empty()) require_shape(dgates, {n, k}, "router dgates");
  if (n == 0) return;
  // d aux / d p[n, e] = E * f_e / N, the same for every token.
  if (count_rows <= 0) count_rows = n;
  std::vector<float> daux_dp(static_cast<std::size_t>(ne));
  for (std::int64_t j = 0; j < ne; ++j)
    daux_dp[j] = static_cast<float>(d_aux * double(ne) * (double(counts[j]) / double(count_rows * k)) / double(n));
  const float zscale = static_cast<float>(2.0 * d_z / double(n));
  parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
    std::vector<float> dp(static_cast<std::size_t>(ne));
    for (std::int64_t i = b; i < e; ++i) {
      const float* p = probs.row(i);
      std::copy(daux_dp.begin(), daux_dp.end(), dp.begin());
      if (!dgates.empty()) {
        const float* dg = dgates.row(i);
        const float* g = gates.row(i);
        const std::int32_t* idx = expert_idx + i * k;
        if (o.renormalize) {
          float sel = 0.f, dot = 0.f;
          for (int kk = 0; kk < k; ++kk) {
            sel += p[idx[kk]];
            dot += dg[kk] * g[kk];
          }
          for (int kk = 0; kk < k; ++kk) dp[idx[kk]] += (dg[kk] - dot) / sel;
        } else {
          for (int kk = 0; kk < k; ++kk) dp[idx[kk]] += dg[kk];
        }
      }
      // Softmax backward: dl = p * (dp - sum p dp); plus the z-loss term 2 lse p / N.
      double pdp = 0;
      for (std::int64_t j = 0; j < ne; ++j) pdp += double(p[j]) * dp[j];
      float* dl = dlogits.row(i);
      for (std::int64_t j = 0; j < ne; ++j) dl[j] = p[j] * (dp[j] - float(pdp)) + zscale * lse[i] * p[j];
    }
  });
}

}  // namespace keel::ops::router

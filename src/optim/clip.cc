#include "optim/clip.h"

#include <algorithm>
#include <cmath>

namespace keel::optim {

double sum_squares(const float* g, std::int64_t n) {
  // Four partial sums: shorter dependency chains, and less rounding for long vectors.
  double s[4] = {0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) s[k] += static_cast<double>(g[i + k]) * g[i + k];
  for (; i < n; ++i) s[0] += static_cast<double>(g[i]) * g[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

double norm_from_sum_squares(double sum_sq) {
  double norm = std::sqrt(sum_sq);
  if (!std::isfinite(norm))
    throw NonFiniteGradient(fmt::format("gradient norm is {} (inf or NaN in the gradients)", norm), "", norm);
  return norm;
}

double clip_coefficient(double norm, double max_norm) {
  if (!std::isfinite(norm)) fail("clip: gradient norm is not finite ({})", norm);
  if (!(max_norm > 0)) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

std::vector<GradView> grad_views(const ParamLayout& layout, float* grads) {
  std::vector<GradView> v;
  v.reserve(layout.params.size());
  for (const auto& p : layout.params) v.push_back({p.name, grads + p.offset, p.numel});
  return v;
}

double global_grad_norm(const std::vector<GradView>& grads) {
  double total = 0;
  for (const auto& g : grads) {
    double s = sum_squares(g.data, g.n);
    if (!std::isfinite(s))
      throw NonFiniteGradient(fmt::format("gradient of '{}' holds inf or NaN (its sum of squares is {})", g.name, s),
                              g.name, std::sqrt(s));
    total += s;
  }
  return norm_from_sum_squares(total);
}

ClipResult clip_grad_norm_deferred(const std::vector<GradView>& grads, double max_norm) {
  ClipResult r;
  r.norm = global_grad_norm(grads);
  r.coefficient = clip_coefficient(r.norm, max_norm);
  r.clipped = r.coefficient < 1.0;
  return r;
}

ClipResult clip_grad_norm(const std::vector<GradView>& grads, double max_norm) {
  ClipResult r = clip_grad_norm_deferred(grads, max_norm);
  if (r.clipped) {
    const float c = static_cast<float>(r.coefficient);
    for (const auto& g : grads)
      for (std::int64_t i = 0; i < g.n; ++i) g.data[i] *= c;
  }
  return r;
}

}  // namespace keel::optim

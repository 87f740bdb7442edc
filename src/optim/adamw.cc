#include "optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::optim {

void validate(const AdamWConfig& c) {
  if (!(std::isfinite(c.beta1) && c.beta1 >= 0 && c.beta1 < 1)) fail("adamw: beta1 must be in [0, 1), got {}", c.beta1);
  if (!(std::isfinite(c.beta2) && c.beta2 >= 0 && c.beta2 < 1)) fail("adamw: beta2 must be in [0, 1), got {}", c.beta2);
  if (!(std::isfinite(c.eps) && c.eps > 0)) fail("adamw: eps must be finite and > 0, got {}", c.eps);
  if (!(std::isfinite(c.weight_decay) && c.weight_decay >= 0))
    fail("adamw: weight_decay must be finite and >= 0, got {}", c.weight_decay);
}

void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t n, const AdamWConfig& c,
                  std::int64_t t, double lr, bool decay, float grad_scale) {
  if (t < 1) fail("adamw: step must be >= 1, got {}", t);
  // Scalars in double, then rounded once to fp32 for the loop.
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(t));
  const float b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
  const float one_b1 = static_cast<float>(1.0 - c.beta1), one_b2 = static_cast<float>(1.0 - c.beta2);
  const float keep = static_cast<float>(1.0 - (decay ? lr * c.weight_decay : 0.0));
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float eps = static_cast<float>(c.eps);
  parallel_for(n, 1 << 16, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      float g = grad_scale * grad[i];
      float mi = b1 * m[i] + one_b1 * g;
      float vi = b2 * v[i] + one_b2 * (g * g);
      m[i] = mi;
      v[i] = vi;
      param[i] = param[i] * keep - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
    }
  });
}

AdamW::AdamW(const AdamWConfig& c) : c_(c) { validate(c_); }

void AdamW::set_step_count(std::int64_t t) {
  if (t < 0) fail("adamw: step count must be >= 0, got {}", t);
  t_ = t;
}

void AdamW::step(const ParamLayout& layout, const FlatRange& r, double lr, float grad_scale) {
  step(layout, std::vector<FlatRange>{r}, lr, grad_scale);
}

void AdamW::step(const ParamLayout& layout, const std::vector<FlatRange>& ranges, double lr, float grad_scale) {
  for (const auto& r : ranges)
    if (r.begin < 0 || r.end < r.begin || r.end > layout.total_floats)
      fail("adamw: range [{}, {}) is outside the flat buffer of {} floats", r.begin, r.end, layout.total_floats);
  if (!(std::isfinite(lr) && lr >= 0)) fail("adamw: lr must be finite and >= 0, got {}", lr);
  if (!std::isfinite(grad_scale)) fail("adamw: grad_scale is not finite ({})", grad_scale);
  ++t_;
  for (const auto& r : ranges)
    for (const auto& p : layout.params) {
      if (p.optimizer != OptimizerKind::kAdamW) continue;
      std::int64_t b = std::max(p.offset, r.begin), e = std::min(p.offset + p.numel, r.end);
      if (b >= e) continue;
      std::int64_t k = b - r.begin;
      adamw_update(r.param + k, r.grad + k, r.m + k, r.v + k, e - b, c_, t_, lr * p.lr_scale, p.weight_decay, grad_scale);
    }
}

}  // namespace keel::optim

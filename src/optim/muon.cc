#include "optim/muon.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace keel::optim {

void validate(const MuonConfig& c) {
  if (!(std::isfinite(c.momentum) && c.momentum >= 0 && c.momentum < 1))
    fail("muon: momentum must be in [0, 1), got {}", c.momentum);
  if (c.ns_steps < 1) fail("muon: ns_steps must be >= 1, got {}", c.ns_steps);
  if (!(std::isfinite(c.weight_decay) && c.weight_decay >= 0))
    fail("muon: weight_decay must be finite and >= 0, got {}", c.weight_decay);
  if (!(std::isfinite(c.rms_target) && c.rms_target > 0))
    fail("muon: rms_target must be finite and > 0, got {}", c.rms_target);
}

double muon_scale(const MuonConfig& c, std::int64_t rows, std::int64_t cols) {
  switch (c.scale) {
    case MuonScale::kMatchAdamW:
    case MuonScale::kExactRms: return c.rms_target * std::sqrt(static_cast<double>(std::max(rows, cols)));
    case MuonScale::kKeller: return std::sqrt(std::max(1.0, static_cast<double>(rows) / static_cast<double>(cols)));
    case MuonScale::kNone: return 1.0;
  }
  return 1.0;
}

std::int64_t muon_scratch_floats(std::int64_t rows, std::int64_t cols) {
  return rows * cols + newton_schulz_scratch_floats(rows, cols);
}

double muon_orthogonalize(float* u, std::int64_t rows, std::int64_t cols, const MuonConfig& c, float* ns_scratch) {
  newton_schulz(u, u, rows, cols, ns_scratch, c.ns_steps, c.coeffs);
  double k = muon_scale(c, rows, cols);
  if (c.scale == MuonScale::kExactRms) {
    const std::int64_t mn = rows * cols;
    double sq = 0;
    for (std::int64_t i = 0; i < mn; ++i) sq += static_cast<double>(u[i]) * u[i];
    double rms = std::sqrt(sq / static_cast<double>(mn));
    k = rms > 0 ? c.rms_target / rms : 0.0;
  }
  return k;
}

void muon_matrix_step(float* param, const float* grad, float* momentum, std::int64_t matrices, std::int64_t rows,
                      std::int64_t cols, const MuonConfig& c, double lr, bool decay, float grad_scale, float* scratch,
                      float* update_out) {
  if (matrices < 1 || rows < 1 || cols < 1)
    fail("muon: bad matrix batch {} x [{}, {}]", matrices, rows, cols);
  const std::int64_t mn = rows * cols;
  float* u = scratch;
  float* ns = scratch + mn;
  const float beta = static_cast<float>(c.momentum), one_beta = static_cast<float>(1.0 - c.momentum);
  const float keep = static_cast<float>(1.0 - (decay ? lr * c.weight_decay : 0.0));
  for (std::int64_t e = 0; e < matrices; ++e) {
    float* p = param + e * mn;
    const float* g = grad + e * mn;
    float* m = momentum + e * mn;
    for (std::int64_t i = 0; i < mn; ++i) {
      float gi = grad_scale * g[i];
      float mi = beta * m[i] + one_beta * gi;
      m[i] = mi;
      u[i] = c.nesterov ? one_beta * gi + beta * mi : mi;
    }
    const double k = muon_orthogonalize(u, rows, cols, c, ns);
    const float kf = static_cast<float>(k), step = static_cast<float>(lr * k);
    for (std::int64_t i = 0; i < mn; ++i) p[i] = p[i] * keep - step * u[i];
    if (update_out)
      for (std::int64_t i = 0; i < mn; ++i) update_out[e * mn + i] = kf * u[i];
  }
}

Muon::Muon(const MuonConfig& c) : c_(c) { validate(c_); }

void Muon::set_step_count(std::int64_t t) {
  if (t < 0) fail("muon: step count must be >= 0, got {}", t);
  t_ = t;
}

void Muon::step_param(const ParamInfo& p, float* param, const float* grad, float* momentum, double lr,
                      float grad_scale) {
  if (p.optimizer != OptimizerKind::kMuon) fail("muon: parameter '{}' is not in a Muon group", p.name);
  if (p.ndim() < 2) fail("muon: parameter '{}' has {} dims; Muon needs >= 2", p.name, p.ndim());
  if (!(std::isfinite(lr) && lr >= 0)) fail("muon: lr must be finite and >= 0, got {}", lr);
  if (!std::isfinite(grad_scale)) fail("muon: grad_scale is not finite ({})", grad_scale);
  auto need = static_cast<std::size_t>(muon_scratch_floats(p.rows(), p.cols()));
  if (scratch_.size() < need) scratch_.resize(need);
  muon_matrix_step(param, grad, momentum, p.matrices(), p.rows(), p.cols(), c_, lr * p.lr_scale, p.weight_decay,
                   grad_scale, scratch_.data());
}

void Muon::step(const ParamLayout& layout, float* params, const float* grads, float* momentum, double lr,
                float grad_scale) {
  ++t_;
  for (const auto& p : layout.params)
    if (p.optimizer == OptimizerKind::kMuon)
      step_param(p, params + p.offset, grads + p.offset, momentum + p.offset, lr, grad_scale);
}

}  // namespace keel::optim

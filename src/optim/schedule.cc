#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "common/error.h"

namespace keel::optim {

void validate(const LrSchedule& s) {
  if (!(std::isfinite(s.peak_lr) && s.peak_lr > 0)) fail("lr schedule: peak_lr must be finite and > 0, got {}", s.peak_lr);
  if (s.warmup_steps < 0) fail("lr schedule: warmup_steps must be >= 0, got {}", s.warmup_steps);
  if (s.kind == ScheduleKind::kConstant) return;
  if (!(std::isfinite(s.min_lr) && s.min_lr >= 0 && s.min_lr <= s.peak_lr))
    fail("lr schedule: min_lr must be in [0, peak_lr = {}], got {}", s.peak_lr, s.min_lr);
  if (s.total_steps < 1) fail("lr schedule: total_steps must be >= 1, got {}", s.total_steps);
  if (s.warmup_steps > s.total_steps)
    fail("lr schedule: warmup_steps ({}) exceed total_steps ({})", s.warmup_steps, s.total_steps);
  if (s.kind == ScheduleKind::kWsd) {
    if (!(s.decay_fraction > 0 && s.decay_fraction <= 1))
      fail("lr schedule: decay_fraction must be in (0, 1], got {}", s.decay_fraction);
    std::int64_t d = wsd_decay_steps(s);
    if (s.warmup_steps + d > s.total_steps)
      fail("lr schedule: warmup_steps ({}) + decay steps ({}) exceed total_steps ({})", s.warmup_steps, d,
           s.total_steps);
  }
}

double decay_factor(DecayShape shape, double p) {
  p = std::clamp(p, 0.0, 1.0);
  switch (shape) {
    case DecayShape::kLinear: return 1.0 - p;
    case DecayShape::kCosine: return 0.5 * (1.0 + std::cos(std::numbers::pi * p));
    case DecayShape::kOneMinusSqrt: return 1.0 - std::sqrt(p);
  }
  return 1.0;
}

std::int64_t wsd_decay_steps(const LrSchedule& s) {
  return std::max<std::int64_t>(1, std::llround(s.decay_fraction * static_cast<double>(s.total_steps)));
}

namespace {
// Progress of `step` through the decay phase that starts at d0 and ends (p = 1) at the last step.
double progress(std::int64_t step, std::int64_t d0, std::int64_t total) {
  std::int64_t last = total - 1;
  if (step >= last) return 1.0;
  if (last <= d0) return step >= d0 ? 1.0 : 0.0;
  return static_cast<double>(step - d0) / static_cast<double>(last - d0);
}
}  // namespace

double lr_at(const LrSchedule& s, std::int64_t step) {
  validate(s);
  if (step < 0) fail("lr schedule: step must be >= 0, got {}", step);
  if (step < s.warmup_steps) return s.peak_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  switch (s.kind) {
    case ScheduleKind::kConstant: return s.peak_lr;
    case ScheduleKind::kCosine: {
      double f = decay_factor(DecayShape::kCosine, progress(step, s.warmup_steps, s.total_steps));
      return s.min_lr + (s.peak_lr - s.min_lr) * f;
    }
    case ScheduleKind::kWsd: {
      std::int64_t d0 = s.total_steps - wsd_decay_steps(s);
      if (step < d0) return s.peak_lr;
      double f = decay_factor(s.decay_shape, progress(step, d0, s.total_steps));
      return s.min_lr + (s.peak_lr - s.min_lr) * f;
    }
  }
  return s.peak_lr;
}

const char* to_string(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kConstant: return "constant";
    case ScheduleKind::kCosine: return "cosine";
    case ScheduleKind::kWsd: return "wsd";
  }
  return "?";
}

const char* to_string(DecayShape d) {
  switch (d) {
    case DecayShape::kLinear: return "linear";
    case DecayShape::kCosine: return "cosine";
    case DecayShape::kOneMinusSqrt: return "1-sqrt";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(const std::string& s) {
  if (s == "constant") return ScheduleKind::kConstant;
  if (s == "cosine") return ScheduleKind::kCosine;
  if (s == "wsd") return ScheduleKind::kWsd;
  fail("unknown lr schedule '{}' (expected constant, cosine or wsd)", s);
}

DecayShape parse_decay_shape(const std::string& s) {
  if (s == "linear") return DecayShape::kLinear;
  if (s == "cosine") return DecayShape::kCosine;
  if (s == "1-sqrt") return DecayShape::kOneMinusSqrt;
  fail("unknown decay shape '{}' (expected linear, cosine or 1-sqrt)", s);
}

}  // namespace keel::optim

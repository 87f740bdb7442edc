// Learning-rate schedules as pure functions of the optimizer step (docs/optim.md).
//
// Steps are 0-based: step s is the (s+1)-th optimizer update. Every schedule returns the
// absolute learning rate (a group's lr_scale multiplies it later). Conventions:
//   - warmup (W steps, W may be 0): lr(s) = peak * (s + 1) / W for s < W, so step 0 is not
//     wasted at lr 0 and step W-1 reaches the peak;
//   - a decay phase over steps [d0, d1] goes from peak at d0 to exactly min_lr at d1 = total-1,
//     the last step of training; steps >= total stay at min_lr (the floor).
// Kinds:
//   constant: warmup, then peak forever.
//   cosine:   warmup, then min + (peak - min) * 0.5 * (1 + cos(pi * p)), p over [W, total-1].
//   wsd:      warmup-stable-decay: warmup, peak until the last `decay_fraction * total` steps,
//             then min + (peak - min) * f(p) with f = 1 - p (linear), 0.5 (1 + cos pi p)
//             (cosine) or 1 - sqrt(p) (1-sqrt, Hagele et al. 2024, arXiv 2405.18392).
// validate() throws keel::Error with one line naming the bad field.
#pragma once

#include <cstdint>
#include <string>

namespace keel::optim {

enum class ScheduleKind { kConstant, kCosine, kWsd };
enum class DecayShape { kLinear, kCosine, kOneMinusSqrt };

struct LrSchedule {
  ScheduleKind kind = ScheduleKind::kCosine;
  double peak_lr = 3e-4;
  double min_lr = 3e-5;             // the floor reached at the last step (cosine, wsd)
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;     // cosine, wsd: the decay ends at step total_steps - 1
  double decay_fraction = 0.1;      // wsd: fraction of total_steps spent decaying (0, 1]
  DecayShape decay_shape = DecayShape::kOneMinusSqrt;  // wsd
};

// Throws keel::Error ("lr schedule: warmup_steps (10) + decay steps (95) exceed total_steps (100)").
void validate(const LrSchedule& s);
// The learning rate at 0-based step `step` (>= 0). Validates `s` first.
double lr_at(const LrSchedule& s, std::int64_t step);
// The decay multiplier f(p) in [0, 1] for progress p in [0, 1] (1 at p = 0, 0 at p = 1).
double decay_factor(DecayShape shape, double p);
// Number of decay steps of a WSD schedule: round(decay_fraction * total_steps), at least 1.
std::int64_t wsd_decay_steps(const LrSchedule& s);

// "constant" / "cosine" / "wsd", "linear" / "cosine" / "1-sqrt"; parse_* throw on anything else.
const char* to_string(ScheduleKind k);
const char* to_string(DecayShape d);
ScheduleKind parse_schedule_kind(const std::string& s);
DecayShape parse_decay_shape(const std::string& s);

}  // namespace keel::optim

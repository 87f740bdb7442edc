// kernels.profile: where a training step's time goes, phase by phase (issue 33's breakdown).
// The GPU backend marks the start of each phase on its compute stream (train/step_profile_cuda.h
// records a CUDA event there); a phase lasts until the next mark, so the phases of a step add up
// to its period on that stream, host stalls included (a phase whose work waits for the host
// shows the wait). Layers' phases of one kind (e.g. every layer's "moe fwd") add up into one row.
// This header is the report's shape, which the trainer prints; CPU builds see only it.
#pragma once

#include <string>
#include <vector>

namespace keel::train {

// The steps kernels.profile leaves out first (cuBLASLt's heuristics, first-touch allocations).
inline constexpr int kProfileWarmupSteps = 2;

struct ProfileRow {
  std::string phase;
  double ms_per_step = 0;  // mean over the counted steps
  double per_step = 0;     // how many times a step entered the phase (e.g. once per layer)
};

struct ProfileReport {
  int steps = 0;          // counted steps
  int skipped = 0;        // the first steps, not counted (warm-up)
  std::vector<ProfileRow> rows;  // in the order the phases first ran
};

// The table keel train prints at its end: one line per phase with its share of the step.
std::string format_profile(const ProfileReport& r);
// The same as JSON (schema keel.train.profile/1), which keel train writes to
// <output_dir>/profile.json.
std::string profile_json(const ProfileReport& r);

}  // namespace keel::train

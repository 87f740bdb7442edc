#include "train/step_profile.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "train/backend.h"

namespace keel::train {

void TrainBackend::enable_profile(int) {
  throw UsageError(fmt::format("kernels.profile: times the GPU step phase by phase (CUDA events); this run is on {}",
                               device()));
}

std::string format_profile(const ProfileReport& r) {
  if (r.steps == 0)
    return fmt::format("step profile: no step counted (the first {} are warm-up; train for more steps)\n", r.skipped);
  double total = 0;
  for (const ProfileRow& p : r.rows) total += p.ms_per_step;
  std::string out = fmt::format(
      "step profile (kernels.profile: CUDA events on the compute stream; mean over {} steps after {} warm-up)\n",
      r.steps, r.skipped);
  out += fmt::format("  {:<34} {:>10} {:>7} {:>9}\n", "phase", "ms/step", "share", "per step");
  for (const ProfileRow& p : r.rows)
    out += fmt::format("  {:<34} {:>10.2f} {:>6.1f}% {:>9.0f}\n", p.phase, p.ms_per_step,
                       total > 0 ? 100 * p.ms_per_step / total : 0.0, p.per_step);
  out += fmt::format("  {:<34} {:>10.2f} {:>6.1f}%\n", "step", total, 100.0);
  return out;
}

std::string profile_json(const ProfileReport& r) {
  nlohmann::json j = {{"schema", "keel.train.profile/1"}, {"steps", r.steps}, {"warmup", r.skipped},
                      {"phases", nlohmann::json::array()}};
  for (const ProfileRow& p : r.rows)
    j["phases"].push_back({{"phase", p.phase}, {"ms_per_step", p.ms_per_step}, {"per_step", p.per_step}});
  return j.dump(1) + "\n";
}

}  // namespace keel::train

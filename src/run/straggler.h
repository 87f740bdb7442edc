// keel run's straggler detection (supervisor.h): a rank whose own work per step stays well above
// the other ranks'. Every rank's heartbeat carries its step time and the part of it spent blocked
// on other ranks (keel::peer_wait_seconds); in a synchronous job every rank's step takes as long
// as the slowest one's, so the step time alone cannot name it, but the slowest rank is the one
// that waits least: its busy time (step - wait) stands out.
//
// Per rank, the median busy time of its last `window` steps (or their minimum: `fastest`); a
// rank is a straggler when that is above `factor` x the median of the other ranks' figures and
// at least `min_gap` seconds above it, for `steps` of its steps in a row. Each rank is reported once. Pure bookkeeping: no
// processes, no files (the supervisor feeds it heartbeats).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <vector>

namespace keel::run {

// The median of v (the mean of the middle two for an even count; 0 for none): the statistic
// keel run's verdicts take over ranks and steps (stragglers, the hang deadline, the pre-flight).
double median_of(std::vector<double> v);

struct StragglerOptions {
  double factor = 1.5;    // 0: off
  int steps = 5;          // steps in a row above the bar
  int window = 5;         // steps per rank in its median
  double min_gap = 0.05;  // seconds above the others at least
  // each rank's figure: the median of its window, or with `fastest` its minimum (the device
  // canary's: a GPU's own speed is its best time, work it shares its SMs with only adds to a
  // sample, so a rank is named only when every sample of its window stays slow)
  bool fastest = false;
};

struct Straggler {
  int rank = -1;
  std::int64_t step = 0;       // the step that confirmed it
  double busy = 0, others = 0;  // its median busy seconds per step, the other ranks'
  std::vector<double> window;    // its window's samples, oldest first (what the verdict read)
};

class StragglerWatch {
 public:
  explicit StragglerWatch(StragglerOptions o) : o_(o) {}
  // Rank `rank`'s step `step` (counted once: a repeated or older step is ignored) took
  // step_seconds, wait_seconds of it blocked on other ranks; world: the job's ranks. Returns the
  // straggler this step confirms, if any.
  std::optional<Straggler> add(int rank, std::int64_t step, double step_seconds, double wait_seconds, int world);

 private:
  struct Rank {
    std::int64_t last_step = -1;
    std::deque<double> busy;
    int above = 0;
    bool reported = false;
  };
  StragglerOptions o_;
  std::map<int, Rank> ranks_;
};

}  // namespace keel::run

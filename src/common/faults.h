// Fault injection for tests and for the supervisor's drills (`keel train --inject SPEC`): a
// rank dies, exits, hangs, slows down, reports a NaN or spiking loss, or finds the disk full at
// a chosen step, as a crashed process, a wedged GPU, a straggler, a diverged run or a full
// file system would.
//
// A spec is a comma-separated list of KIND@STEP[:rRANK][:ARG] (steps 1-based, ranks world ranks,
// default 0):
//   kill@S[:rR]            at the start of step S, rank R sends itself SIGKILL
//   exit@S[:rR][:CODE]     ... calls _exit(CODE) (default 3, 0-255)
//   hang@S[:rR]            ... stops making progress (hang_forever, common/watchdog.h)
//   slow@S[-E][:rR][:MS]   at the start of each step S..E (E = S by default) sleeps MS ms (default 500)
//   nan@S[:rR]             the loss of step S on rank R is NaN (the trainer asks nan_at)
//   spike@S[:rR][:FACTOR]  the loss of step S on rank R is multiplied by FACTOR (> 0, default 100)
//                          before the reduction over ranks (the trainer asks loss_factor_at)
//   diskfull@S[:rR]        rank R's write of the checkpoint of step S fails as with ENOSPC
//                          (nothing when step S saves no checkpoint; the trainer asks disk_full_at)
//   slowsave@S[:rR][:MS]   rank R's writes of the checkpoint of step S take at least MS ms
//                          (default 5000), paced evenly over the bytes, as a saturated disk would
//                          (the trainer asks save_delay_ms_at)
//   slowgpu@S[-E][:rR][:F] at steps S..E rank R's device canary (keel run's GPU straggler check:
//                          TrainBackend::device_canary_seconds) runs its loop F times as long
//                          (default 4), as a GPU F times slower would (GPUs only)
//   health@A[:rR]          keel run's pre-flight health check before attempt A finds rank R's
//                          GEMM and memory figures at a hundredth of what it measured (a failing
//                          GPU; keel run's gate, run/preflight.h: keel train ignores it)
// Each fault that fires prints one line "keel: fault injection: ..." to stderr first.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

struct Fault {
  enum class Kind { kKill, kExit, kHang, kSlow, kNan, kSpike, kDiskFull, kHealth, kSlowGpu, kSlowSave };
  Kind kind = Kind::kKill;
  std::int64_t first_step = 1, last_step = 1;  // the steps it fires at, inclusive (a range for slow only;
                                               // health: the attempt)
  int rank = 0;                                // world rank
  int exit_code = 3;                           // exit
  std::int64_t sleep_ms = 500;                 // slow (slowsave: 5000, set by the parser)
  double factor = 100;                         // spike
  int repeats = 4;                             // slowgpu
  std::string spec;                            // the word it was parsed from ("kill@3:r1"), for messages
};

struct FaultPlan {
  std::vector<Fault> faults;

  bool empty() const { return faults.empty(); }
  // Adds every fault of `other` (the union).
  void add(const FaultPlan& other) { faults.insert(faults.end(), other.faults.begin(), other.faults.end()); }
  // What is due on world rank `rank` at the start of step `step` (1-based), before any of its
  // work: sleeps for slow faults, then kills, exits or hangs (not returning) for the others.
  void before_step(std::int64_t step, int rank) const;
  // Whether the loss of step `step` on world rank `rank` is to be NaN.
  bool nan_at(std::int64_t step, int rank) const;
  // What the loss of step `step` on world rank `rank` is to be multiplied by (1: no spike).
  double loss_factor_at(std::int64_t step, int rank) const;
  // Whether world rank `rank`'s write of the checkpoint of step `step` is to fail as on a full disk.
  bool disk_full_at(std::int64_t step, int rank) const;
  // How long world rank `rank`'s writes of the checkpoint of step `step` are to take at least (ms; 0: no fault).
  std::int64_t save_delay_ms_at(std::int64_t step, int rank) const;
  // How many times world rank `rank`'s device canary runs its loop at step `step` (1: no fault).
  int canary_repeats_at(std::int64_t step, int rank) const;
};

// Parses a spec (above). A malformed word is a keel::UsageError of one line naming it:
// "--inject kil@3: unknown fault 'kil' (kill, exit, hang, slow, nan, spike, diskfull, slowsave, health, slowgpu)" (`flag`
// names the source).
FaultPlan parse_faults(const std::string& spec, const std::string& flag = "--inject");

}  // namespace keel

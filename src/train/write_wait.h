// Waiting for a checkpoint's background writes while keel run watches the heartbeats.
//
// A rank blocks on its checkpoint writes before a save that follows a stop request, a loss
// spike or a non-finite step, before the next save when the previous one is still writing, and at
// the end of a run. A large state takes tens of seconds there (25 GB at 1.4 GB/s: 18 s), far
// beyond keel run's hang deadline of a few steps, and the blocked rank posts no heartbeat: keel
// run took such waits for hangs and killed the ranks mid-save (PERFORMANCE.md, the 2-GPU soak).
// So the wait polls instead, every `interval` seconds: every rank's writes done yet (one small
// collective, which every rank of the job reaches at the same point), and how many bytes the job
// has written. While the bytes grow, it beats; a write that stops moving (a wedged disk) stops
// the beats, and keel run's deadline still catches it.
#pragma once

#include <cstdint>
#include <functional>

namespace keel::train {

struct WriteProgress {
  bool all_done = false;   // every rank's writes of the save in flight are done
  std::int64_t bytes = 0;  // the job's bytes written so far (all ranks)
};

// Polls `poll` every `interval_s` until it reports all_done; calls `beat` after each poll whose
// byte count moved past the last beat's (so at most once per interval). Returns the beats.
int wait_for_writes(const std::function<WriteProgress()>& poll, const std::function<void()>& beat, double interval_s);

}  // namespace keel::train

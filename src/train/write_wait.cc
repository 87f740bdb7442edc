#include "train/write_wait.h"

#include <chrono>
#include <thread>

namespace keel::train {

int wait_for_writes(const std::function<WriteProgress()>& poll, const std::function<void()>& beat, double interval_s) {
  int beats = 0;
  std::int64_t beaten = -1;
  for (;;) {
    const WriteProgress p = poll();
    if (p.all_done) return beats;
    if (beaten >= 0 && p.bytes != beaten) {  // the first poll sets the mark: a beat means progress since
      beat();
      ++beats;
    }
    if (beaten < 0 || p.bytes != beaten) beaten = p.bytes;
    std::this_thread::sleep_for(std::chrono::duration<double>(interval_s));
  }
}

}  // namespace keel::train

#include "common/watchdog.h"

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "common/error.h"
#include "common/process.h"

namespace keel {

Watchdog::Watchdog() : thread_([this] { watch(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::arm(std::string what, double seconds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    what_ = std::move(what);
    seconds_ = seconds;
    // duration_cast of a huge (or infinite) limit overflows into a deadline in the past, which
    // would report a hang at once; such a limit means "never", so leave the watchdog disarmed.
    armed_ = seconds < kNoDeadlineSeconds;
    if (armed_)
      deadline_ = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(seconds));
  }
  cv_.notify_all();
}

void Watchdog::disarm() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }
  cv_.notify_all();
}

void Watchdog::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (!armed_) {
      cv_.wait(lock);
      continue;
    }
    if (cv_.wait_until(lock, deadline_) == std::cv_status::timeout && armed_ && !stop_ &&
        std::chrono::steady_clock::now() >= deadline_) {
      report_error(fmt::format("{} did not finish within {:g} s (--timeout): a rank hung or died", what_, seconds_));
      std::fflush(stdout);
      std::_Exit(kExitTimeout);
    }
  }
}

}  // namespace keel

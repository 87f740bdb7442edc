// Turns a hang into an error. A collective whose peer died or stalled never returns, so a
// background thread watches a deadline: past it, the process prints one line naming what
// hung and exits with kExitTimeout. Under mpirun the launcher then tears the other ranks down.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace keel {

class Watchdog {
 public:
  Watchdog();
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts (or restarts) the countdown for `what`. A limit of kNoDeadlineSeconds or more (or
  // +inf) means "no deadline": the watchdog stays disarmed instead of overflowing the clock.
  void arm(std::string what, double seconds);

  // About 31 years: beyond it a deadline would overflow steady_clock's int64 nanoseconds.
  static constexpr double kNoDeadlineSeconds = 1e9;
  void disarm();

 private:
  void watch();

  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, stop_ = false;
  std::string what_;
  double seconds_ = 0;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;
};

// Arms the watchdog for the lifetime of a scope.
class WatchdogScope {
 public:
  WatchdogScope(Watchdog& w, std::string what, double seconds) : w_(w) { w_.arm(std::move(what), seconds); }
  ~WatchdogScope() { w_.disarm(); }

 private:
  Watchdog& w_;
};

}  // namespace keel

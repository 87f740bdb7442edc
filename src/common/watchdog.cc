#include "common/watchdog.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "common/error.h"
#include "common/process.h"

namespace keel {

namespace {

// The PeerWait record: what the main thread waits in (null: not waiting) and since when
// (steady_clock nanoseconds). Written by the main thread, read by the watchdog's.
std::atomic<const char*> g_wait_what{nullptr};
std::atomic<std::int64_t> g_wait_since{0};
std::atomic<std::int64_t> g_waited_ns{0};  // the outermost scopes' time, summed

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

PeerWait::PeerWait(const char* what) noexcept
    : prev_what_(g_wait_what.load(std::memory_order_relaxed)), prev_since_(g_wait_since.load(std::memory_order_relaxed)) {
  g_wait_since.store(now_ns(), std::memory_order_relaxed);
  g_wait_what.store(what, std::memory_order_release);
}

PeerWait::~PeerWait() {
  if (!prev_what_)  // the outermost scope: its whole time (nested ones lie inside it)
    g_waited_ns.fetch_add(now_ns() - g_wait_since.load(std::memory_order_relaxed), std::memory_order_relaxed);
  g_wait_since.store(prev_since_, std::memory_order_relaxed);
  g_wait_what.store(prev_what_, std::memory_order_release);
}

double peer_wait_seconds() { return static_cast<double>(g_waited_ns.load(std::memory_order_relaxed)) * 1e-9; }

void check_timeout_flag(double seconds) {
  if (!(seconds >= 0))
    throw UsageError(fmt::format("--timeout {}: must be seconds >= 0 (0 or inf: no deadline)", seconds));
}

void hang_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

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
    // So does 0 (--timeout 0: no deadline), not an instant hang.
    armed_ = seconds > 0 && seconds < kNoDeadlineSeconds;
    if (armed_)
      deadline_ = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(seconds));
  }
  cv_.notify_all();
}

void Watchdog::on_timeout(std::function<void()> f) {
  std::lock_guard<std::mutex> lock(mu_);
  on_timeout_ = std::move(f);
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
      const std::string late = fmt::format("{} did not finish within {:g} s (--timeout)", what_, seconds_);
      if (!track_peer_waits_) {
        report_error(late + ": a rank hung or died");
      } else if (const char* waiting = g_wait_what.load(std::memory_order_acquire)) {
        const double waited = static_cast<double>(now_ns() - g_wait_since.load(std::memory_order_relaxed)) * 1e-9;
        report_error(fmt::format("{}: this rank waited {:.1f} s in {}: another rank hung or died", late, waited,
                                 waiting));
        std::fflush(stdout);
        // Let the stuck rank's own report out first: the launcher stops the job at the first exit.
        const double grace = std::min(30.0, std::max(1.0, 0.1 * seconds_));
        cv_.wait_for(lock, std::chrono::duration<double>(grace), [this] { return stop_; });
      } else {
        report_error(late + ": this rank is the stuck one (it was not waiting on another rank)");
      }
      std::fflush(stdout);
      if (on_timeout_) {
        // On a thread of its own, so that a hook that itself hangs cannot keep the process alive.
        auto done = std::make_shared<std::atomic<bool>>(false);
        std::thread([f = on_timeout_, done] {
          f();
          done->store(true);
        }).detach();
        for (int i = 0; i < 500 && !done->load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      std::_Exit(kExitTimeout);
    }
  }
}

}  // namespace keel

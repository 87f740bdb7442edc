// Turns a hang into an error. A collective whose peer died or stalled never returns, so a
// background thread watches a deadline: past it, the process prints one line naming what
// hung and exits with kExitTimeout. Under mpirun the launcher then tears the other ranks down.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace keel {

// keel's `--timeout S`, the same in every command that has one (bench comm, train, ckpt
// demo-save and demo-load): seconds a phase may take, default kDefaultTimeoutSeconds; 0 or inf
// (or anything from Watchdog::kNoDeadlineSeconds) means no deadline, which Watchdog::arm takes
// as it is. Throws keel::UsageError naming the flag for a negative or NaN value.
inline constexpr double kDefaultTimeoutSeconds = 600;
void check_timeout_flag(double seconds);

class Watchdog {
 public:
  Watchdog();
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts (or restarts) the countdown for `what`. A limit of 0 (or less, or NaN), or of
  // kNoDeadlineSeconds or more (or +inf), means "no deadline": the watchdog stays disarmed
  // instead of firing at once or overflowing the clock.
  void arm(std::string what, double seconds);

  // About 31 years: beyond it a deadline would overflow steady_clock's int64 nanoseconds.
  static constexpr double kNoDeadlineSeconds = 1e9;
  void disarm();

  // Says the program marks every place it blocks on other ranks with a PeerWait (below), so a
  // timeout can tell which rank is stuck: a rank past its deadline outside any PeerWait reports
  // itself as the stuck one and exits at once; a rank inside one reports what it waited in and
  // for how long, then waits a grace period (a tenth of the limit, 1 to 30 s) before exiting,
  // so that the stuck rank's own report gets out before the launcher tears the job down.
  // Without it (the default) every rank reports the same line.
  void track_peer_waits() { track_peer_waits_ = true; }

  // Runs `f` on the watchdog's thread after the report and before the process exits, e.g. to
  // abort the run's NCCL communicators (parallel::Mesh::abort_all) so that GPU work stuck in a
  // collective returns. The exit waits for it at most 5 s.
  void on_timeout(std::function<void()> f);

 private:
  void watch();

  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, stop_ = false;
  std::string what_;
  double seconds_ = 0;
  std::atomic<bool> track_peer_waits_{false};
  std::function<void()> on_timeout_;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;
};

// Marks the process as blocked on other ranks for its lifetime: inside a collective, or in a
// GPU sync whose queue may hold collectives. One process-wide record, restored on exit so that
// scopes nest: for the thread that drives the collectives (the main thread) only. `what` must
// outlive the scope (a literal).
class PeerWait {
 public:
  explicit PeerWait(const char* what) noexcept;
  ~PeerWait();
  PeerWait(const PeerWait&) = delete;
  PeerWait& operator=(const PeerWait&) = delete;

 private:
  const char* prev_what_;
  std::int64_t prev_since_;
};

// The time this process has spent inside PeerWait scopes so far (seconds; nested scopes counted
// once): keel train reports each step's share in its heartbeat, so that keel run can tell a rank
// that is slow from the ranks that wait for it (a straggler). On GPUs the syncs count as waits,
// the rank's own kernels included: there it sees host-side slowness only.
double peer_wait_seconds();

// Fault injection (tests' --inject-hang flags): blocks this thread forever outside any PeerWait,
// as a wedged process would, so the watchdogs of this rank and its peers must catch it.
[[noreturn]] void hang_forever();

// Arms the watchdog for the lifetime of a scope.
class WatchdogScope {
 public:
  WatchdogScope(Watchdog& w, std::string what, double seconds) : w_(w) { w_.arm(std::move(what), seconds); }
  ~WatchdogScope() { w_.disarm(); }

 private:
  Watchdog& w_;
};

}  // namespace keel

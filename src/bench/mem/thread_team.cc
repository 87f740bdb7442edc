#include "bench/mem/thread_team.h"

namespace keel::bench {

ThreadTeam::ThreadTeam(int threads) : size_(threads < 1 ? 1 : threads) {
  for (int t = 1; t < size_; ++t) threads_.emplace_back([this, t] { work(t); });
}

ThreadTeam::~ThreadTeam() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadTeam::run(const std::function<void(int, int)>& fn) {
  if (size_ == 1) {
    fn(0, 1);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    pending_.store(size_ - 1);
    generation_.fetch_add(1);
  }
  start_cv_.notify_all();
  fn(0, size_);
  // Members finish at about the same time; a short spin avoids a sleep/wake round trip
  // that would dominate small, cache-resident runs.
  for (int spin = 0; spin < 20000 && pending_.load(std::memory_order_acquire) > 0; ++spin) std::this_thread::yield();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_.load() == 0; });
}

void ThreadTeam::work(int member) {
  unsigned long seen = 0;
  for (;;) {
    for (int spin = 0; spin < 20000 && generation_.load(std::memory_order_acquire) == seen; ++spin)
      std::this_thread::yield();
    const std::function<void(int, int)>* fn;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      if (stop_) return;
      fn = fn_;
    }
    (*fn)(member, size_);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_all();
    }
  }
}

}  // namespace keel::bench

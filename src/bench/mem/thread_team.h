// A fixed team of threads that runs one function on every member and waits for all of them:
// the CPU stand-in for a kernel launch. Members keep their slice of an array across runs, so
// pages first touched by a thread stay near it (as STREAM's OpenMP loops arrange).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace keel::bench {

class ThreadTeam {
 public:
  explicit ThreadTeam(int threads);  // threads >= 1; the caller is member 0
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  int size() const { return size_; }
  // Runs fn(member, size) on every member and returns when all are done.
  void run(const std::function<void(int, int)>& fn);

  // The half-open slice [begin, end) of n items that member t of n_members owns.
  static void slice(std::uint64_t n, int t, int n_members, std::uint64_t* begin, std::uint64_t* end) {
    *begin = n * static_cast<std::uint64_t>(t) / static_cast<std::uint64_t>(n_members);
    *end = n * static_cast<std::uint64_t>(t + 1) / static_cast<std::uint64_t>(n_members);
  }

 private:
  void work(int member);

  int size_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int, int)>* fn_ = nullptr;
  std::atomic<unsigned long> generation_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;
};

}  // namespace keel::bench

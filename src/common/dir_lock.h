// An exclusive lock on a directory, so two runs cannot write into one at once (keel train's
// output_dir and checkpoint.dir, docs/train.md). The lock is flock(2) on DIR/.keel-lock: the
// kernel releases it when the holding process dies however it dies, so a lock file left behind
// by a killed run is stale by construction and the next run takes it over. The file holds one
// line naming the holder (host, pid, start time, what it runs) for the refusal to quote.
//
// The lock belongs to the process: taking it again in the same process (two objects of one run,
// tests) shares the one lock, released when the last handle goes.
#pragma once

#include <memory>
#include <string>
#include <utility>

namespace keel {

class DirLock {
 public:
  struct Result {
    std::shared_ptr<DirLock> lock;  // null when refused (or locks are unsupported there)
    std::string holder;     // refused: the holder's line from the lock file ("" if it wrote none yet)
    std::string stale;      // taken over: the line a dead holder left ("" when the file was clean)
    std::string unsupported;  // the file system refused flock (its error): no lock, no refusal
  };
  // Takes the lock of `dir` (which must exist) for this process, writing `who` as the holder's
  // description. Never blocks. Throws keel::Error naming the file when it cannot be opened.
  static Result acquire(const std::string& dir, const std::string& who);

  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  const std::string& path() const { return path_; }
  static constexpr const char* kFileName = ".keel-lock";

 private:
  DirLock(int fd, std::string path, unsigned long long dev, unsigned long long ino)
      : fd_(fd), path_(std::move(path)), dev_(dev), ino_(ino) {}
  int fd_;
  std::string path_;
  unsigned long long dev_, ino_;
};

// "pid 1234 on host node7 since 2026-11-21 10:00:00 UTC (keel train)": the holder line.
std::string lock_holder_line(const std::string& what);

}  // namespace keel

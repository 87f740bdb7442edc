// A rank's heartbeat file for keel run, written off the training thread.
//
// The step loop posts each heartbeat and goes on; a thread of its own writes it (through
// DIR/rank-<r>.json.tmp and a rename). A file system that stalls, as a journaling one can while
// a checkpoint's tens of gigabytes are flushed to the same disk, then delays the file and never
// the step. (The 10 s stale heartbeats of the GPU soaks, once blamed on such a stall, were a
// rank blocked on its checkpoint writes: train/write_wait.h, docs/PERFORMANCE.md.)
// Records posted while one is being written are coalesced: only the newest is written next.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace keel::train {

class HeartbeatWriter {
 public:
  // write(text): puts one record where keel run reads it; returns "" or why it could not.
  using WriteFn = std::function<std::string(const std::string& text)>;
  explicit HeartbeatWriter(WriteFn write);
  // Writes the last record posted (if not yet written), then stops.
  ~HeartbeatWriter();
  HeartbeatWriter(const HeartbeatWriter&) = delete;
  HeartbeatWriter& operator=(const HeartbeatWriter&) = delete;

  // Hands a record over and returns at once; replaces a posted record not yet being written.
  void post(std::string text);
  // Returns once every record posted so far has been written (or has failed).
  void flush();
  // The first write failure not yet taken ("" if none): reported once by the caller.
  std::string take_error();

 private:
  void loop();

  WriteFn write_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::optional<std::string> pending_;
  std::uint64_t posted_ = 0, written_ = 0;  // records posted / written (or coalesced away)
  bool stop_ = false;
  std::string error_;
  std::thread thread_;
};

// What one heartbeat says (keel run reads it: run/supervisor.cc, beat_of). The rank's identity
// (rank, world, host, pid, gpu: empty on the CPU) is the same in every record of a run.
struct HeartbeatRecord {
  int rank = 0, world = 1;
  std::string host, gpu;
  std::int64_t pid = 0;
  const char* phase = "";  // start, step, save, done
  std::int64_t step = 0;
  double time = 0;                // unix seconds
  double step_seconds = 0;        // the last step's
  double wait_seconds = 0;        // of it, blocked on other ranks (PeerWait)
  double device_seconds = 0;      // the device canary (0: none)
};
// One line of JSON, no newline; tag (the attempt's, datagrams only) last when not empty.
std::string heartbeat_json(const HeartbeatRecord& r, const std::string& tag = "");

// The file writer keel train uses: DIR/rank-<rank>.json through a .tmp file and a rename, DIR
// created when missing; no fsync (a heartbeat lost to a crash of the machine is stale anyway).
HeartbeatWriter::WriteFn heartbeat_file_writer(std::string dir, int rank);

}  // namespace keel::train

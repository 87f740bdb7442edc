// Asynchronous, deduplicated, bucketed checkpoint saves with an atomic commit.
//
// save() pays only for copying each shard this rank writes into reusable host staging
// buffers (page-locked when a shard lives in GPU memory, so the device-to-host copy runs at
// the link's rate; plain memcpy for host shards), then returns. Background
// threads, one per bucket, write each bucket's buffer to its own data file with large
// sequential writes (chunk_bytes, default 8 MiB), CRC32C every shard and fsync. Written data
// goes to disk as it is written (flush_behind_bytes: each window's writeback is started when it
// is full and waited for one window later; the clean pages stay cached for a restart), so dirty
// pages never pile up to the checkpoint's size: the final fsync has one window left to flush,
// and the training thread's own small writes (heartbeats, metrics) do not queue behind the
// flush of tens of gigabytes. wait() runs the commit on the calling thread: every rank's
// report is gathered at rank 0, which checks that every tensor is covered exactly once, writes
// metadata.json (temp, fsync, rename, fsync dir) and then `latest`, applies retention, and
// broadcasts the outcome so every rank returns the same stats or throws the same error.
//
// One save is in flight at a time: save() while one is in flight first completes it (wait()),
// so the caller sees the earlier save's error there. MPI calls happen only in save() and
// wait(), on the caller's thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/comm.h"
#include "ckpt/layout.h"
#include "ckpt/types.h"

namespace keel::ckpt {

// One tensor as this rank holds it. Every rank lists every tensor it holds; `write` is true
// on exactly one replica of each distinct shard (see rank_shard), and `data` then points to
// box.volume() elements, row-major, valid only during save(): in host memory, or with
// `on_device` in the current GPU's memory (the caller has synchronized the stream that wrote
// it; save() copies it straight into pinned staging).
struct SaveShard {
  std::string name;
  ElemType type = ElemType::kF32;
  Shape shape;
  mesh::Placement placement;
  Box box;
  const void* data = nullptr;
  bool write = false;
  bool on_device = false;
};

struct SaveOptions {
  int threads = 2;                           // write buckets (files) per rank
  std::uint64_t chunk_bytes = 8ull << 20;    // bytes per write call
  // Write-behind window (0: off, the data waits in the page cache for the final fsync). Where
  // the file system does not support sync_file_range the writer goes on without it.
  std::uint64_t flush_behind_bytes = 256ull << 20;
  int keep_last = 0;                         // retention: newest K committed (0 = all)
  int keep_every = 0;                        // retention: also every step divisible by M
  // Fault injection (tests): this rank _exit()s after writing this many bytes; or the write
  // of its data fails as on a full disk.
  std::int64_t die_after_bytes = -1;
  bool fail_with_enospc = false;
  // The same per save: asked once by save() with its step (keel train --inject diskfull@S).
  std::function<bool(std::int64_t step)> fail_with_enospc_at;
  // How long this rank's writes of each save take at least (ms; 0: as fast as they go), paced
  // evenly over the bytes as a saturated disk would write them (keel train --inject slowsave@S).
  std::function<std::int64_t(std::int64_t step)> write_delay_ms_at;
};

struct SaveStats {
  std::int64_t step = 0;
  std::string dir;
  double stall_s = 0;         // time inside save() on this rank (staging copy; waiting for a previous save)
  double write_s = 0;         // slowest rank's background write time
  double blocked_s = 0;       // wait() blocked on this rank's writers (0 when the writes fully overlapped)
  double commit_s = 0;        // wait() after the writes: gather, checks, metadata, latest, retention
  std::uint64_t bytes = 0;    // bytes written by all ranks
  std::uint64_t flushed_behind = 0;  // of this rank's bytes, those flushed while writing (flush_behind_bytes)
  int files = 0;
  double write_gbps() const { return write_s > 0 ? bytes / write_s / 1e9 : 0; }
  std::vector<std::string> removed;  // directories retention removed
};

class Saver {
 public:
  Saver(Comm& comm, std::string root, SaveOptions options = {});
  ~Saver();
  Saver(const Saver&) = delete;
  Saver& operator=(const Saver&) = delete;

  // Starts saving `step`. `state` (rank 0's is kept) holds the non-tensor state; `rank_state`
  // is kept per rank (RNG states, ...). Returns the stall in seconds.
  double save(std::int64_t step, const std::vector<SaveShard>& shards, const nlohmann::json& state,
              const nlohmann::json& rank_state, const std::string& layout);
  // Allocates (and touches) the staging buffers a save of `shards` will use (`data` is not read),
  // so the first save's stall is the copy alone: pinned allocation of gigabytes takes seconds.
  // Not while a save is in flight. No communication.
  void reserve(const std::vector<SaveShard>& shards);
  // Completes the in-flight save (collective). nullopt when none was in flight.
  std::optional<SaveStats> wait();
  bool in_flight() const { return in_flight_; }
  // True once this rank's background writes are done (no communication).
  bool writes_done() const { return pending_.load() == 0; }
  // Bytes this rank's writes of the save in flight have handed to the file system so far.
  std::int64_t bytes_written() const { return written_.load(); }

 private:
  struct Bucket;
  void write_bucket(Bucket& b);

  Comm& comm_;
  std::string root_;
  SaveOptions opt_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::thread> threads_;
  std::atomic<int> pending_{0};
  std::atomic<std::int64_t> written_{0};
  bool in_flight_ = false;
  bool enospc_ = false;  // this save's writes fail as on a full disk (fault injection)
  std::int64_t delay_ms_ = 0;  // this save's writes take at least this long (fault injection)
  std::int64_t step_ = 0;
  std::string dir_, layout_;
  double stall_s_ = 0;
  nlohmann::json report_;  // this rank's tensors, shard records (less file results) and state
};

}  // namespace keel::ckpt

// The `keel bench comm` harness: sweeps ranks x ops x dtypes x reduce ops x sizes over a
// backend, times each case, checks each result outside the timed loop, and reduces the
// per-rank measurements into rows on rank 0.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench/comm/backend.h"

namespace keel::bench {

enum class Placement { kBoth, kOutOfPlace, kInPlace };

struct CommOptions {
  std::string backend = "auto";  // auto | nccl | mpi
  std::vector<Collective> ops = {Collective::kAllReduce};
  std::vector<DType> dtypes = {DType::kFP32};
  std::vector<RedOp> redops = {RedOp::kSum};
  Placement placement = Placement::kBoth;
  std::uint64_t min_bytes = 8, max_bytes = 64ull << 20;
  double factor = 2.0;
  std::vector<int> ranks;        // empty: the whole world
  bool all_groups = false;       // run every sub-group of each size at once
  int root = 0;
  TimingPlan plan;
  bool check = true;
  std::uint64_t seed = 1;
  std::string json_path, csv_path, plot_path;
  double min_busbw = 0;          // GB/s; 0 disables the gate
  int hang_rank = -1;            // fault injection (tests): this rank stops taking part
  bool hang_at_start = false;    // ... before the communicators exist, not in the first case
  int corrupt_rank = -1;         // fault injection (tests): this rank's checked output is overwritten
  int error_rank = -1;           // fault injection (tests): this rank fails with an error
  bool quiet = false;            // no table on stdout
};

struct PlacementResult {
  bool measured = false;
  double time_us = 0;            // host-timed loop, averaged over ranks (nccl-tests' default)
  double algbw = 0, busbw = 0;   // GB/s (1e9)
  double iter_p50_us = 0, iter_p99_us = 0;  // per-iteration, slowest rank of each iteration
  int slowest_rank = -1;
  double slowest_rank_us = 0;    // mean per-iteration time of the slowest rank
  std::uint64_t wrong = 0;
  std::string first_wrong;       // where the first wrong value was, if any
};

struct ResultRow {
  Collective op;
  DType dtype;
  RedOp redop;
  bool reduces;
  int nranks, group, ngroups;
  std::uint64_t size_bytes, count;
  PlacementResult out_of_place, in_place;
};

struct CommReport {
  std::string backend;
  int world_size = 0;
  std::vector<DeviceDescription> devices;
  std::map<std::string, std::string> versions;
  std::vector<ResultRow> rows;
};

// The message sizes of one (op, dtype, group size) series: --min to --max by --factor. A
// typed --min or --max must split as the op needs (else keel::Error); sizes in between are
// rounded down to a multiple that does (so -f 1.5 works), duplicates dropped.
std::vector<std::uint64_t> case_sizes(const CommOptions& o, Collective op, DType t, int nranks);

// The buffers one rank of the sweep holds at most (every group size, op, dtype and size of `o`
// on a world of `world` ranks): what the memory check before the sweep compares.
SweepBuffers largest_buffers(const CommOptions& o, int world);

// The host-memory check of CPU ranks (--backend mpi), pure so it can be tested with any numbers:
// `ranks_on_host` ranks each holding `need` (send + receive + MPI's reduction scratch) against
// `available` bytes (MemAvailable); "" when they fit in 90% of it, else one line naming the
// host, the need and what to change.
std::string host_memory_problem(const SweepBuffers& need, int ranks_on_host, std::uint64_t available,
                                const std::string& host);

// Validates options against the world (collective: every rank throws the same UsageError).
void validate_options(const CommOptions& o, int world_size);
// Receives results on rank 0 as the sweep produces them (the live table).
class RowSink {
 public:
  virtual ~RowSink() = default;
  virtual void begin_block(const ResultRow& first) = 0;  // a new (ranks, op, dtype, redop) series
  virtual void row(const ResultRow& r) = 0;
};

// Runs the sweep. Rows are complete on rank 0 only. Returns the number of wrong values seen.
CommReport run_comm_bench(Backend& backend, const CommOptions& o, RowSink* sink);

// Percentile by nearest rank on a copy of `v` (p in [0, 100]).
double percentile(std::vector<double> v, double p);

}  // namespace keel::bench

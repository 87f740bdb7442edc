// The seam between the benchmark harness and a communication library. A backend drives the
// ranks this process owns (one under a launcher; every local GPU when NCCL runs without
// one) and knows how to fill, run, time and check a collective on them. The harness (runner)
// owns the sweep, the statistics and the report, so every backend is measured the same way.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/comm/collective.h"
#include "bench/comm/values.h"

namespace keel::bench {

struct CollectiveCase {
  Collective op = Collective::kAllReduce;
  DType dtype = DType::kFP32;
  RedOp redop = RedOp::kSum;
  bool in_place = false;
  int root = 0;
  CollectiveShape shape;
  int nranks = 1;  // ranks in each group
};

// The parts of a case that define its expected values (values.h).
inline CaseGeometry geometry_of(const CollectiveCase& c) {
  CaseGeometry g;
  g.op = c.op;
  g.redop = c.redop;
  g.root = c.root;
  g.send_count = c.shape.send_count;
  g.recv_count = c.shape.recv_count;
  return g;
}

struct TimingPlan {
  int warmup = 5;
  int iters = 20;
  int graph_replays = 0;  // > 0: capture `iters` ops into a CUDA graph and replay it this many times
  double timeout_s = 600;  // keel's --timeout default (common/watchdog.h); 0 or inf: no deadline
};

// One rank's measurements of one case.
struct RankTiming {
  int rank = 0;
  double seconds_per_op = 0;          // host-timed loop over all iterations, divided by them
  std::vector<double> iter_seconds;   // per-iteration times (device events or host clock)
};

// One rank's check of one case.
struct RankCheck {
  int rank = 0;
  std::uint64_t wrong = 0;
  std::int64_t first_wrong = -1;      // element index in the output buffer, -1 if none
  float got = 0, expected = 0;
};

// The most memory one rank of a sweep holds (runner.h's largest_buffers): its send and receive
// buffers at their largest over every case, and the largest message of a reducing case (MPI's
// reductions may take a scratch buffer of up to that size inside the library).
struct SweepBuffers {
  std::uint64_t send = 0, recv = 0, reduce = 0;
};

struct DeviceDescription {
  int rank = 0;
  std::string host;
  std::string name;    // e.g. "NVIDIA H200" or "cpu"
  std::string bus_id;  // PCI bus id for GPUs
  int device = -1;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int world_size() const = 0;
  virtual const std::vector<int>& local_ranks() const = 0;
  virtual std::vector<DeviceDescription> local_devices() const = 0;
  virtual std::map<std::string, std::string> library_versions() const = 0;

  // Collective over the world: groups of `group_size` consecutive ranks. With `all_groups`
  // every full group is formed and runs at once (to see contention); otherwise only ranks
  // [0, group_size) take part and the rest sit the measurement out.
  virtual void form_groups(int group_size, bool all_groups) = 0;
  // Why the sweep's buffers cannot fit this process's memory, or "" when they can; called
  // before anything is allocated (not collective). `ranks_on_host`: the world's processes on
  // this host, whose buffers share its memory.
  virtual std::string memory_problem(const SweepBuffers& need, int ranks_on_host) const = 0;
  // Allocates (or keeps) buffers of at least these sizes on every owned rank.
  virtual void reserve(std::uint64_t send_bytes, std::uint64_t recv_bytes) = 0;
  // Times the case on the owned ranks that are in a group; others add nothing to `out`.
  virtual void measure(const CollectiveCase& c, const TimingPlan& plan, std::vector<RankTiming>* out) = 0;
  // Fills fresh inputs from `seed`, poisons the outputs, runs the case once and compares
  // every output element with its expected value.
  virtual void check(const CollectiveCase& c, std::uint64_t seed, double timeout_s, std::vector<RankCheck>* out) = 0;

  // Fault injection, to prove the detectors work: `hang` stops this rank taking part (the
  // --timeout watchdog must fire); `corrupt` overwrites one output element of this rank after
  // the checked run (the checker must report it).
  void set_hang_rank(int rank) { hang_rank_ = rank; }
  // The run failed: on release, abort communicators instead of waiting for work in flight.
  void set_failed() { failed_ = true; }
  void set_corrupt_rank(int rank) { corrupt_rank_ = rank; }
  void set_error_rank(int rank) { error_rank_ = rank; }

 protected:
  // The value and place an injected corruption writes: never a valid result.
  static constexpr float kCorruptValue = 12288.f;  // exact in bf16, fp16 and fp32
  static std::uint64_t corrupt_index(std::uint64_t count) { return count / 2; }

  int hang_rank_ = -1;
  int corrupt_rank_ = -1;
  int error_rank_ = -1;  // this rank fails its first measurement with an error
  bool failed_ = false;
};

std::unique_ptr<Backend> make_mpi_backend();
#if defined(KEEL_HAVE_CUDA)
std::unique_ptr<Backend> make_nccl_backend(int max_ranks);
#endif

}  // namespace keel::bench

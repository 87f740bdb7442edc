// The seam between `keel bench mem`'s harness and the memory it measures. A backend owns the
// arrays, fills them, runs and times one case, and verifies what the runs left behind; the
// runner owns the sweep and turns times into bandwidth, so CPU and GPU are counted alike.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/mem/ops.h"

namespace keel::bench {

struct MemDevice {
  int index = 0;
  std::string name;         // "NVIDIA H200", or the CPU model
  int sm_count = 0;         // SMs (GPU) or worker threads (CPU)
  std::uint64_t l2_bytes = 0;      // GPU L2, or the CPU's last-level cache
  std::uint64_t memory_bytes = 0;  // device memory, or host RAM
  std::string bus_id;
};

struct MemCase {
  MemOp op = MemOp::kCopy;
  MemType type = MemType::kF32;
  std::uint64_t elements = 0;  // per array
  int src = 0, dst = 0;        // devices (peer ops); the measured device otherwise
};

struct MemPlan {
  int warmup = 5;
  int iters = 50;
  double min_sample_us = 20;  // small arrays: each sample repeats the op until it lasts this long
  bool check = true;
  std::uint64_t seed = 1;
  bool corrupt = false;       // testing: damage one output element after the runs
};

struct MemResult {
  std::vector<double> seconds;  // per run, one entry per timed sample
  int batch = 1;                // runs per sample
  std::uint64_t runs = 0;       // every run since the inputs were filled (warm-up included)
  bool checked = false;
  std::uint64_t wrong = 0;      // output elements off their expected value
  std::string first_wrong;      // "element i: got x, expected y"
  double dot = 0;               // dot's result (checked by the runner against a host sum)
  std::uint64_t dot_chain = 1;  // longest chain of sequential T-precision additions in it
  bool p2p = true;              // peer ops: false when the copy was staged through the host
  std::string launch;           // GPU kernels: the launch shape timed faster ("grid-stride", "one-shot")
};

class MemBackend {
 public:
  virtual ~MemBackend() = default;
  virtual std::string name() const = 0;  // "cuda" or "cpu"
  virtual std::vector<MemDevice> devices() const = 0;
  virtual std::map<std::string, std::string> library_versions() const = 0;
  // Why `op` cannot run here ("" when it can): no GPU peer, no host link on a CPU...
  virtual std::string unsupported_reason(MemOp op) const = 0;
  // Throws keel::Error with a clear message when the case's arrays cannot fit in memory.
  virtual void check_fits(const MemCase& c) const = 0;
  // Fills fresh inputs from plan.seed, runs warm-up and timed samples, and (plan.check)
  // verifies every output element.
  virtual MemResult run(const MemCase& c, const MemPlan& plan) = 0;
};

std::unique_ptr<MemBackend> make_cpu_mem_backend(int threads);
#if defined(KEEL_HAVE_CUDA)
// All visible GPUs; `device` is the one single-device ops run on. Throws when there is none.
std::unique_ptr<MemBackend> make_cuda_mem_backend(int device);
#endif

}  // namespace keel::bench

// The `keel bench mem` harness: sweeps ops x array sizes (x GPU pairs for peer ops) over a
// backend, turns the times into bandwidth the BabelStream way, checks every case and relates
// each figure to the device's spec peak and to the best this run measured.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench/mem/backend.h"

namespace keel::bench {

struct MemOptions {
  std::string backend = "auto";  // auto | cuda | cpu
  std::vector<MemOp> ops;        // empty: everything the backend can run
  std::vector<MemOp> named_ops;  // named one by one (not through a group): unsupported is an error
  MemType type = MemType::kF32;
  std::uint64_t min_bytes = 0, max_bytes = 0;  // per array; 0: the backend's default
  double factor = 2.0;
  MemPlan plan;
  int device = 0;
  int threads = 0;               // CPU backend: 0 = every hardware thread
  double peak_gbps = 0;          // > 0: overrides the memory spec peak (CPUs have none built in)
  std::string json_path, csv_path, plot_path;
  bool quiet = false;
};

struct MemRow {
  MemOp op = MemOp::kCopy;
  MemType type = MemType::kF32;
  std::uint64_t array_bytes = 0, elements = 0, bytes = 0;  // bytes: moved per run
  int src = 0, dst = 0;          // GPUs (peer ops); the measured device otherwise
  int batch = 1, samples = 0;
  double best_us = 0, median_us = 0;
  double gbps = 0, gbps_median = 0;  // bytes / best time, bytes / median time (1e9 B/s)
  double peak_gbps = 0;          // the spec figure this op is held against; 0: unknown
  double pct_peak = -1, pct_best = -1;  // -1: unknown
  bool checked = false;
  std::uint64_t wrong = 0;
  std::string first_wrong;
  bool p2p = true;
  std::string launch;            // GPU kernels: launch shape kept ("grid-stride" or "one-shot")
};

struct MemReport {
  std::string backend;
  std::vector<MemDevice> devices;  // the measured device first
  std::map<std::string, std::string> versions;
  std::vector<std::string> notes;  // ops left out, and why
  std::vector<MemRow> rows;
};

// The most CPU-backend threads --threads takes: 4 x the hardware threads, and at least 64 so a
// small CI machine still runs a test's fixed thread count. Beyond the cores the team only
// oversubscribes them (every run wakes every thread), so a huge count runs for ages and
// measures the scheduler, not memory.
int max_cpu_threads();

// Default sweep per backend: GPUs from cache-resident 256 KiB to 2 GiB per array (many times
// any L2); CPUs from 64 KiB to 256 MiB.
std::uint64_t default_min_bytes(const std::string& backend);
std::uint64_t default_max_bytes(const std::string& backend);

// The spec bandwidth an op is held against on `device` (GB/s), or 0 when unknown: HBM for
// kernels and memcpy, PCIe for host transfers, NVLink per direction (x2 both ways) for peers.
double mem_spec_gbps(MemOp op, const MemDevice& device, double override_gbps);

// Validates and fills in defaults; throws keel::UsageError.
void resolve_mem_options(MemOptions& o, const MemBackend& backend, MemReport* report);

// Runs the sweep; `on_op` sees each op's rows as soon as they are complete.
MemReport run_mem_bench(MemBackend& backend, MemOptions& o,
                        const std::function<void(const MemReport&, std::size_t first_row)>& on_op);

// The dot product of the inputs a and b of `seed` in double, over host threads.
double expected_dot(MemType t, std::uint64_t seed, std::uint64_t n);

}  // namespace keel::bench

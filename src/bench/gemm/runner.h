// The `keel bench gemm` harness: times every (shape, dtype) on a backend, checks sampled
// outputs against a double-precision host reference, and adds what explains the number:
// % of the spec peak, the algorithm and its tile, the waves on this device's SMs, and the
// share of work lost to partial tiles.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench/gemm/backend.h"
#include "bench/gemm/tiling.h"

namespace keel::bench {

struct GemmOptions {
  std::string backend = "auto";  // auto | cuda | cpu
  std::vector<GemmType> dtypes;  // empty: bf16 on GPUs, fp32 on CPUs
  std::vector<GemmShape> shapes;
  std::string mode;              // "sweep", "list" or "model"
  std::string model;             // model mode: the YAML file or "flags"
  std::int64_t tokens = 0;       // model mode
  GemmPlan plan;
  int device = 0;
  int threads = 0;
  double peak_tflops = 0;        // > 0: overrides the spec peak
  std::string json_path, csv_path, plot_path, plot_x = "auto";
  bool quiet = false;
  std::vector<std::string> notes;
};

struct GemmRow {
  GemmShape shape;
  GemmType type = GemmType::kBF16;
  double flops = 0;
  double median_us = 0, min_us = 0, mean_us = 0;
  double tflops = 0, tflops_best = 0;  // at the median and at the fastest run
  double peak_tflops = 0, pct_peak = -1;
  GemmAlgo algo;
  TileStats tiles;
  int rotating_sets = 1;
  bool checked = false;
  int samples = 0, wrong = 0;
  std::uint64_t nonfinite = 0;
  std::string first_wrong;
  double worst_ratio = 0;
  std::string skipped;
};

struct GemmReport {
  std::string backend;
  GemmDevice device;
  std::map<std::string, std::string> versions;
  std::vector<GemmRow> rows;
};

// Fills in defaults and validates against the backend (a dtype it lacks, fp8 with a layout
// cuBLASLt cannot run); throws keel::UsageError.
void resolve_gemm_options(GemmOptions& o, const GemmBackend& backend);

GemmReport run_gemm_bench(GemmBackend& backend, GemmOptions& o, const std::function<void(const GemmRow&)>& on_row);

}  // namespace keel::bench

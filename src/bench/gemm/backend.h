// The seam between `keel bench gemm`'s harness and a GEMM library. A backend owns the
// operands, picks the algorithm (cuBLASLt heuristics, autotuned, or cached), times the GEMM
// and hands back sampled operands and outputs for the host reference check; the runner owns
// the sweep, the statistics and the report.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/gemm/shapes.h"
#include "bench/gemm/types.h"

namespace keel::bench {

struct GemmDevice {
  std::string name;          // "NVIDIA H200", or the CPU model
  int sm_count = 0;          // SMs; CPU: BLAS threads
  std::uint64_t l2_bytes = 0;      // GPU L2, or the CPU's last-level cache
  std::uint64_t memory_bytes = 0;
  std::string compute_capability;  // "9.0"; empty on CPUs
};

struct GemmPlan {
  int warmup = 5;
  int iters = 30;
  int candidates = 16;        // cuBLASLt heuristic results to time; <= 1: take the first
  int tune_iters = 5;         // timed runs per candidate
  std::uint64_t workspace = 32ull << 20;
  std::uint64_t rotate_bytes = 0;  // operand bytes to cycle through between reuses; 0: 4 x L2
  bool check = true;
  int check_samples = 64;
  std::uint64_t seed = 1;
  std::string tune_cache;     // file of tuned algorithms; empty: none
  bool retune = false;        // ignore cached choices (and overwrite them)
  bool corrupt = false;       // testing: damage one sampled output
};

struct GemmAlgo {
  std::string source;         // "autotuned", "heuristic", "cache" or "openblas"
  std::string description;    // e.g. "algo 66 tile 128x256 stages 3 cluster 2x1 splitK 1 swizzle 0"
  int tile_m = 0, tile_n = 0; // output tile along m and n (0: unknown / not tiled)
  int split_k = 1;
  int cluster_m = 1, cluster_n = 1;
  double lt_waves = -1;       // cuBLASLt's own wavesCount; -1 when not given
  int candidates = 0;         // heuristic results timed
  int chosen_rank = 0;        // the winner's place in the heuristic's order (0 = its first choice)
  double first_choice_us = 0; // median time of the heuristic's first choice while tuning
  std::uint64_t workspace = 0;
};

// One sampled output element with what it was computed from.
struct GemmSample {
  std::int64_t batch = 0, i = 0, j = 0;
  double got = 0;
  std::vector<float> a;  // row i of op(A): k values as stored (exactly converted to float)
  std::vector<float> b;  // column j of op(B)
};

struct GemmResult {
  std::vector<double> seconds;  // per timed GEMM
  int rotating_sets = 1;        // operand sets cycled so each GEMM reads from memory, not L2
  GemmAlgo algo;
  std::string skipped;          // non-empty: the library has no algorithm for this shape
  // The check (fresh inputs, output poisoned with NaN before one run).
  bool checked = false;
  double scale = 1;             // fp8: scale_a * scale_b, which multiplies every dot product
  std::uint64_t nonfinite = 0;  // output elements left NaN/inf (unwritten or overflowed)
  std::vector<GemmSample> samples;
};

class GemmBackend {
 public:
  virtual ~GemmBackend() = default;
  virtual std::string name() const = 0;  // "cublaslt" or "openblas"
  virtual GemmDevice device() const = 0;
  virtual std::map<std::string, std::string> library_versions() const = 0;
  // Why this backend cannot run `t` ("" when it can).
  virtual std::string unsupported_type(GemmType t) const = 0;
  // Throws keel::Error when one operand set of the shape cannot fit in memory.
  virtual void check_fits(const GemmShape& s, GemmType t, const GemmPlan& plan) const = 0;
  virtual GemmResult run(const GemmShape& s, GemmType t, const GemmPlan& plan,
                         const std::vector<std::array<std::int64_t, 3>>& check_positions) = 0;
  // Writes tuned choices to plan.tune_cache (no-op where nothing was tuned).
  virtual void save_tuning() {}
};

std::unique_ptr<GemmBackend> make_openblas_backend(int threads);
#if defined(KEEL_HAVE_CUDA)
std::unique_ptr<GemmBackend> make_cublaslt_backend(int device, const std::string& tune_cache);
#endif

}  // namespace keel::bench

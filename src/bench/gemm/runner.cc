#include "bench/gemm/runner.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "bench/gemm/check.h"
#include "common/error.h"
#include "hw/hardware.h"

namespace keel::bench {

void resolve_gemm_options(GemmOptions& o, const GemmBackend& backend) {
  try {
    if (o.dtypes.empty()) o.dtypes = {backend.name() == "openblas" ? GemmType::kFP32 : GemmType::kBF16};
    for (GemmType t : o.dtypes) {
      const std::string why = backend.unsupported_type(t);
      if (!why.empty()) fail("dtype {}: {}", gemm_type_name(t), why);
    }
    if (o.shapes.empty()) fail("no GEMM shapes to run");
    for (const auto& s : o.shapes)
      if (s.m <= 0 || s.n <= 0 || s.k <= 0 || s.batch <= 0)
        fail("GEMM {}x{}x{} (batch {}) has a non-positive dimension", s.m, s.n, s.k, s.batch);
    if (o.plan.iters < 1) fail("--iters must be at least 1");
    if (o.plan.warmup < 0) fail("--warmup must not be negative");
    if (o.plan.check_samples < 1) fail("--check-samples must be at least 1");
    const bool fp8 = std::find(o.dtypes.begin(), o.dtypes.end(), GemmType::kFP8) != o.dtypes.end();
    if (fp8 && backend.name() == "cublaslt") {
      // cuBLASLt's fp8 kernels take only the column-major "TN" form, which is our "nt".
      if (o.mode == "model")
        o.notes.push_back("fp8 rows run every pass as layout nt (cuBLASLt's fp8 GEMMs need it; fp8 training "
                          "transposes operands explicitly)");
      else
        for (const auto& s : o.shapes)
          if (s.layout != Layout::kNT)
            fail("fp8 needs --layout nt (cuBLASLt's fp8 GEMMs take A as stored [m x k] and B as stored [n x k])");
    }
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

GemmReport run_gemm_bench(GemmBackend& backend, GemmOptions& o, const std::function<void(const GemmRow&)>& on_row) {
  GemmReport report;
  report.backend = backend.name();
  report.device = backend.device();
  report.versions = backend.library_versions();
  const hw::HardwareProfile* profile = hw::match_device_name(report.device.name);

  // Fail before the sweep if the largest shape cannot fit.
  for (GemmType t : o.dtypes) {
    const GemmShape* largest = &o.shapes.front();
    for (const auto& s : o.shapes)
      if (s.m * s.n + s.m * s.k + s.k * s.n > largest->m * largest->n + largest->m * largest->k + largest->k * largest->n)
        largest = &s;
    backend.check_fits(*largest, t, o.plan);
  }

  std::uint64_t case_index = 0;
  for (GemmType t : o.dtypes) {
    for (GemmShape s : o.shapes) {
      if (t == GemmType::kFP8 && backend.name() == "cublaslt") s.layout = Layout::kNT;
      GemmPlan plan = o.plan;
      plan.seed = o.plan.seed * 1000003 + ++case_index;  // fresh inputs for every case
      const auto positions = gemm_check_positions(s, o.plan.check_samples, plan.seed);
      GemmResult r = backend.run(s, t, plan, positions);
      GemmRow row;
      row.shape = s;
      row.type = t;
      row.flops = s.flops();
      row.skipped = r.skipped;
      row.algo = r.algo;
      row.rotating_sets = r.rotating_sets;
      row.peak_tflops = o.peak_tflops > 0 ? o.peak_tflops : profile ? gemm_spec_tflops(t, *profile) : 0;
      if (r.skipped.empty()) {
        std::vector<double> v = r.seconds;
        std::sort(v.begin(), v.end());
        const double med = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
        row.median_us = med * 1e6;
        row.min_us = v.front() * 1e6;
        row.mean_us = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()) * 1e6;
        row.tflops = row.flops / med / 1e12;
        row.tflops_best = row.flops / v.front() / 1e12;
        if (row.peak_tflops > 0) row.pct_peak = 100.0 * row.tflops / row.peak_tflops;
        row.tiles = tile_stats(s.m, s.n, s.batch, r.algo.tile_m, r.algo.tile_n, r.algo.split_k, report.device.sm_count);
        if (r.checked) {
          const GemmCheckOutcome c = check_gemm(r, t, s.k);
          row.checked = true;
          row.samples = c.samples;
          row.wrong = c.wrong;
          row.first_wrong = c.first_wrong;
          row.worst_ratio = c.worst_ratio;
          row.nonfinite = r.nonfinite;
        }
      }
      report.rows.push_back(row);
      if (on_row) on_row(report.rows.back());
    }
  }
  backend.save_tuning();
  return report;
}

}  // namespace keel::bench

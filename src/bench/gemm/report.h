// How `keel bench gemm` reports: one table row per GEMM as it finishes, a footer (checks, and
// the layer's total in model mode), a versioned JSON document (keel.bench.gemm/1, the layout
// of keel.bench.comm/1), CSV, and PNG plots of TFLOP/s against one dimension.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "bench/gemm/runner.h"

namespace keel::bench {

inline constexpr const char* kGemmJsonSchema = "keel.bench.gemm/1";

void print_gemm_header(const GemmBackend& backend, const GemmOptions& o, std::FILE* out);
void print_gemm_row(const GemmRow& r, std::FILE* out);
// Returns the number of failed checks (wrong samples plus rows with non-finite outputs).
std::uint64_t print_gemm_summary(const GemmReport& report, const GemmOptions& o, std::FILE* out);

void write_gemm_json(const GemmReport& report, const GemmOptions& o, const std::string& path);
void write_gemm_csv(const GemmReport& report, const std::string& path);
// TFLOP/s against the swept dimension (--plot-x, or the one that varies most), one curve per
// dtype, layout and fixed other dimensions; against GFLOP per GEMM when nothing is swept.
std::vector<std::string> write_gemm_plots(const GemmReport& report, const GemmOptions& o, const std::string& path);

// Failed checks over all rows.
std::uint64_t gemm_failures(const GemmReport& report);

}  // namespace keel::bench

// `keel bench gemm`: GEMM kernel-sizing sweeps (cuBLASLt on GPUs, OpenBLAS on CPUs).
#pragma once

#include <CLI/CLI.hpp>

namespace keel::bench {

void add_gemm_command(CLI::App& bench);

}  // namespace keel::bench

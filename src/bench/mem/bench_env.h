// Environment worth recording in a benchmark's JSON: anything that changes how CUDA, NCCL,
// OpenBLAS or OpenMP behave. Shared by `keel bench mem` and `keel bench gemm`.
#pragma once

#include <nlohmann/json.hpp>

namespace keel::bench {

nlohmann::json bench_relevant_env();

}  // namespace keel::bench

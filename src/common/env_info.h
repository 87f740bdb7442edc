// The environment worth recording in a benchmark's JSON: the variables that change how CUDA,
// NCCL, cuBLAS, MPI, OpenBLAS or OpenMP behave, and the Slurm job shape.
#pragma once

#include <nlohmann/json.hpp>

namespace keel {

nlohmann::json recorded_env();

}  // namespace keel

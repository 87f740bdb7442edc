// How many CUDA devices this process can use: the one place backends ask before choosing a
// GPU path, so a HIP port changes it here.
#pragma once

namespace keel {

// Number of visible CUDA devices; 0 without a driver or device, and in a CPU-only build.
int visible_cuda_devices();
// Makes `device` (0-based, < visible_cuda_devices()) current for this thread; throws
// keel::Error when it cannot (or in a CPU-only build).
void set_cuda_device(int device);
// Whether KEEL_NCCL_OVER_MPI is set (and not 0): a test mode in which several ranks of a host
// share one GPU and the GPU collectives are staged through host memory and MPI
// (parallel/nccl_group.h). Slow: never for training.
bool nccl_over_mpi();

}  // namespace keel

// Small helpers shared by the tests that run under mpiexec (tests/**/*_mpi_test.cc).
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "device/cuda_devices.h"

namespace keel::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Whether every rank of the world (2 or more) has a GPU: one each, or in the KEEL_NCCL_OVER_MPI
// test mode (device/cuda_devices.h) one shared by all. use_rank_gpu() makes it current.
inline bool gpu_per_rank() {
  const int n = world_size(), visible = visible_cuda_devices();
  return n >= 2 && (visible >= n || (visible >= 1 && nccl_over_mpi()));
}
inline void use_rank_gpu() { set_cuda_device(world_rank() % visible_cuda_devices()); }

// An empty directory every rank of the world sees: <tmp>/keel_<tag>_np<ranks>_<name>_<pid of
// rank 0>, made by rank 0 and named to the others. Collective.
inline std::filesystem::path shared_temp_dir(const std::string& tag, const std::string& name) {
  std::string path;
  if (world_rank() == 0) {
    const std::filesystem::path d = std::filesystem::temp_directory_path() /
                                    ("keel_" + tag + "_np" + std::to_string(world_size()) + "_" + name + "_" +
                                     std::to_string(::getpid()));
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    path = d.string();
  }
  int n = static_cast<int>(path.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  path.resize(static_cast<std::size_t>(n));
  MPI_Bcast(path.data(), n, MPI_CHAR, 0, MPI_COMM_WORLD);
  return path;
}

}  // namespace keel::test

#include "device/rank_gpu.h"

#include <mpi.h>

#include <fmt/format.h>

#include "common/error.h"
#include "common/host.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "device/cuda_devices.h"

#if defined(KEEL_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace keel {

int rank_gpu_index(int local_rank, int local_size, int visible, const std::string& host) {
  if (local_rank < 0 || local_rank >= local_size)
    fail("rank_gpu_index: node-local rank {} of {} ranks", local_rank, local_size);
  if (visible >= local_size) return local_rank;
  if (visible == 1) return 0;
  throw UsageError(fmt::format("{} ranks run on host {} and each sees {} GPUs: launch one rank per GPU, with every "
                               "GPU visible to every rank or one GPU per rank (e.g. srun --gpus-per-task 1)",
                               local_size, host, visible));
}

std::pair<int, int> first_shared_gpu(const std::vector<std::string>& uuids) {
  for (std::size_t b = 1; b < uuids.size(); ++b)
    for (std::size_t a = 0; a < b; ++a)
      if (uuids[a] == uuids[b]) return {static_cast<int>(a), static_cast<int>(b)};
  return {-1, -1};
}

namespace {

// The current device's UUID as 32 hex digits.
std::string current_gpu_uuid() {
#if defined(KEEL_HAVE_CUDA)
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess)
    fail("cudaGetDeviceProperties: cannot read the current GPU's UUID");
  std::string hex;
  for (const char byte : prop.uuid.bytes) hex += fmt::format("{:02x}", static_cast<unsigned char>(byte));
  return hex;
#else
  fail("this keel was built without CUDA");
#endif
}

}  // namespace

int bind_rank_gpu() {
  int rank = 0;
  mpi_check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  MPI_Comm node;
  {
    PeerWait wait("MPI_Comm_split_type (the ranks of this host)");
    mpi_check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
              "MPI_Comm_split_type");
  }
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  const std::string host = host_name();
  int device = -1;
  std::string uuid(32, '?'), error;
  try {
    device = rank_gpu_index(local_rank, local_size, visible_cuda_devices(), host);
    set_cuda_device(device);
    uuid = current_gpu_uuid();
  } catch (const Error& e) {
    error = e.what();
  }
  // Every rank of the node takes part (an error included), so all of them fail alike.
  std::vector<char> all(static_cast<std::size_t>(local_size) * 32);
  int failed = error.empty() ? 0 : 1, any_failed = 0;
  int rc1 = MPI_SUCCESS, rc2 = MPI_SUCCESS;
  {
    PeerWait wait("MPI_Allgather (the GPU each rank of this host picked)");
    rc1 = MPI_Allgather(uuid.data(), 32, MPI_CHAR, all.data(), 32, MPI_CHAR, node);
    rc2 = MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, node);
  }
  MPI_Comm_free(&node);
  mpi_check(rc1, "MPI_Allgather (GPU UUIDs)");
  mpi_check(rc2, "MPI_Allreduce");
  if (!error.empty()) throw UsageError(error);
  if (any_failed) throw UsageError(fmt::format("another rank on host {} could not pick its GPU", host));
  std::vector<std::string> uuids;
  for (int r = 0; r < local_size; ++r) uuids.emplace_back(all.data() + 32 * r, 32);
  const auto [a, b] = first_shared_gpu(uuids);
  if (a >= 0 && !nccl_over_mpi())
    throw UsageError(fmt::format("node-local ranks {} and {} on host {} would drive the same GPU (UUID {}...): "
                                 "launch one rank per GPU",
                                 a, b, host, uuids[static_cast<std::size_t>(a)].substr(0, 8)));
  return device;
}

}  // namespace keel

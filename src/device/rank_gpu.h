// Which GPU a rank drives when a launcher (mpirun, srun) starts one process per GPU. Launchers
// do it one of two ways: every rank sees all of its node's GPUs, and the node-local rank picks
// one; or each rank is bound to its own GPU (srun --gpus-per-task 1, or a CUDA_VISIBLE_DEVICES
// per rank), so it sees exactly one, device 0. Both are accepted; anything else is refused
// before any GPU work, and so are two ranks of a node on one physical GPU (mpirun -n 2 on a
// one-GPU node: each rank sees one device, the same one).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace keel {

// The visible device index for node-local rank `local_rank` of `local_size` ranks when each
// sees `visible` GPUs: local_rank when visible >= local_size, 0 when visible == 1. Throws
// UsageError otherwise (several GPUs visible, but fewer than the node's ranks) naming `host`.
int rank_gpu_index(int local_rank, int local_size, int visible, const std::string& host);

// The first two node-local ranks (a < b) whose GPUs have the same UUID, or {-1, -1}.
std::pair<int, int> first_shared_gpu(const std::vector<std::string>& uuids);

// Under MPI with more than one rank: makes this rank's GPU (rank_gpu_index over the ranks of
// its node) current and checks that no two ranks of the node drive the same physical GPU
// (except in the KEEL_NCCL_OVER_MPI test mode: cuda_devices.h).
// Collective over MPI_COMM_WORLD; every rank of a node fails alike (UsageError). Returns the
// device index. Needs a CUDA build with a visible GPU.
int bind_rank_gpu();

}  // namespace keel

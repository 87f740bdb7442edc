// The NCCL operations the overlapped ZeRO-1 step needs (zero1_buckets.h, docs/parallel.md), each
// enqueued on a stream the caller names (a cudaStream_t), so gradient reduces and parameter
// broadcasts can run on a communication stream beside the compute stream. One communicator per
// object, built over an MPI communicator; every rank must issue the same operations in the same
// order. Nothing here synchronizes the host.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>

namespace keel::parallel {

enum class NcclType { kFloat32, kBfloat16, kFloat64, kUint32 };

class NcclGroup {
 public:
  virtual ~NcclGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // In place: the sum over the group lands in buf on `root`; other ranks' buf is only read.
  virtual void reduce_sum(void* buf, std::int64_t count, NcclType type, int root, void* stream) = 0;
  // In place: root's buf to every rank.
  virtual void broadcast(void* buf, std::int64_t count, NcclType type, int root, void* stream) = 0;
  virtual void all_reduce_sum(void* buf, std::int64_t count, NcclType type, void* stream) = 0;
  // send: size() x count elements; recv (count): this rank's chunk of the element-wise sum.
  // recv may be send + rank() x count (in place).
  virtual void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, NcclType type, void* stream) = 0;
  // send: count elements; recv: size() x count, every rank's in rank order. send may be
  // recv + rank() x count (in place).
  virtual void all_gather(const void* send, void* recv, std::int64_t count, NcclType type, void* stream) = 0;
  virtual void send(const void* buf, std::int64_t count, NcclType type, int peer, void* stream) = 0;
  virtual void recv(void* buf, std::int64_t count, NcclType type, int peer, void* stream) = 0;
  // ncclGroupStart / ncclGroupEnd: the operations between them launch together.
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  // ncclCommAbort: operations in flight return, the communicator is unusable afterwards (a peer
  // died or hangs; parallel::Mesh::abort_all). Safe from another thread.
  virtual void abort() = 0;
};

// Every rank of `comm` calls this together, with its CUDA device set (MPI_COMM_NULL: this
// process alone). Throws keel::Error in a build without CUDA. parallel::Mesh makes and owns the
// communicators of a training run's groups.
// With KEEL_NCCL_OVER_MPI set (not 0), the group's operations are staged through host memory and
// run by MPI instead: a test mode in which several ranks share one GPU (NCCL refuses that), so
// the multi-rank GPU code runs where fewer GPUs than ranks are at hand. Slow and synchronous:
// never for training (keel::nccl_over_mpi, device/cuda_devices.h).
std::unique_ptr<NcclGroup> make_nccl_group(MPI_Comm comm);

}  // namespace keel::parallel

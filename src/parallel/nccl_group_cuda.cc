#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "device/cuda_check.h"
#include "parallel/nccl_comm_cuda.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {

ncclComm_t nccl_comm_from_mpi(MPI_Comm comm, int* size, int* rank) {
  PeerWait wait("forming an NCCL communicator (every rank of the group joins)");
  mpi_check(MPI_Comm_size(comm, size), "MPI_Comm_size");
  mpi_check(MPI_Comm_rank(comm, rank), "MPI_Comm_rank");
  ncclUniqueId id{};
  if (*rank == 0) KEEL_NCCL_CHECK(ncclGetUniqueId(&id));
  mpi_check(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm), "MPI_Bcast (NCCL id)");
  ncclComm_t c = nullptr;
  KEEL_NCCL_CHECK(ncclCommInitRank(&c, *size, id, *rank));
  return c;
}

namespace {

ncclDataType_t nccl_type(NcclType t) {
  switch (t) {
    case NcclType::kFloat32: return ncclFloat32;
    case NcclType::kBfloat16: return ncclBfloat16;
    case NcclType::kFloat64: return ncclFloat64;
    case NcclType::kUint32: return ncclUint32;
  }
  return ncclFloat32;
}

class Nccl final : public NcclGroup {
 public:
  explicit Nccl(MPI_Comm comm) { comm_ = nccl_comm_from_mpi(comm == MPI_COMM_NULL ? MPI_COMM_SELF : comm, &size_, &rank_); }
  ~Nccl() override {
    if (comm_ && !aborted_.load()) ncclCommDestroy(comm_);
  }
  int size() const override { return size_; }
  int rank() const override { return rank_; }

  void reduce_sum(void* buf, std::int64_t count, NcclType type, int root, void* stream) override {
    KEEL_NCCL_CHECK(ncclReduce(buf, buf, static_cast<std::size_t>(count), nccl_type(type), ncclSum, root, comm_,
                               static_cast<cudaStream_t>(stream)));
  }
  void broadcast(void* buf, std::int64_t count, NcclType type, int root, void* stream) override {
    KEEL_NCCL_CHECK(ncclBroadcast(buf, buf, static_cast<std::size_t>(count), nccl_type(type), root, comm_,
                                  static_cast<cudaStream_t>(stream)));
  }
  void all_reduce_sum(void* buf, std::int64_t count, NcclType type, void* stream) override {
    KEEL_NCCL_CHECK(ncclAllReduce(buf, buf, static_cast<std::size_t>(count), nccl_type(type), ncclSum, comm_,
                                  static_cast<cudaStream_t>(stream)));
  }
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, NcclType type, void* stream) override {
    KEEL_NCCL_CHECK(ncclReduceScatter(send, recv, static_cast<std::size_t>(count), nccl_type(type), ncclSum, comm_,
                                      static_cast<cudaStream_t>(stream)));
  }
  void all_gather(const void* send, void* recv, std::int64_t count, NcclType type, void* stream) override {
    KEEL_NCCL_CHECK(ncclAllGather(send, recv, static_cast<std::size_t>(count), nccl_type(type), comm_,
                                  static_cast<cudaStream_t>(stream)));
  }
  void send(const void* buf, std::int64_t count, NcclType type, int peer, void* stream) override {
    KEEL_NCCL_CHECK(ncclSend(buf, static_cast<std::size_t>(count), nccl_type(type), peer, comm_,
                             static_cast<cudaStream_t>(stream)));
  }
  void recv(void* buf, std::int64_t count, NcclType type, int peer, void* stream) override {
    KEEL_NCCL_CHECK(ncclRecv(buf, static_cast<std::size_t>(count), nccl_type(type), peer, comm_,
                             static_cast<cudaStream_t>(stream)));
  }
  void group_start() override { KEEL_NCCL_CHECK(ncclGroupStart()); }
  void group_end() override { KEEL_NCCL_CHECK(ncclGroupEnd()); }
  void abort() override {
    if (comm_ && !aborted_.exchange(true)) ncclCommAbort(comm_);
  }

 private:
  ncclComm_t comm_ = nullptr;
  int size_ = 1, rank_ = 0;
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<NcclGroup> make_nccl_group(MPI_Comm comm) { return std::make_unique<Nccl>(comm); }

}  // namespace keel::parallel

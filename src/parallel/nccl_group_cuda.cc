#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "device/cuda_check.h"
#include "parallel/nccl_comm_cuda.h"
#include "parallel/nccl_group.h"
#include "device/cuda_devices.h"

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

// ---- KEEL_NCCL_OVER_MPI: the same operations staged through host memory and MPI ----
// For tests only: several ranks on one GPU (which NCCL refuses), to run the multi-rank GPU code
// where fewer GPUs than ranks are at hand. Each operation waits for its stream, copies its
// input to the host, runs the MPI collective and copies the result back before returning; the
// operations between group_start and group_end run at group_end, in order (point-to-point ones
// together, non-blocking). Slow, and no overlap: never for training.

std::size_t elem_size(NcclType t) {
  switch (t) {
    case NcclType::kBfloat16: return 2;
    case NcclType::kFloat64: return 8;
    default: return 4;
  }
}

void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    std::uint32_t x = std::uint32_t(a[i]) << 16, y = std::uint32_t(b[i]) << 16;
    float fx, fy;
    std::memcpy(&fx, &x, 4), std::memcpy(&fy, &y, 4);
    const float z = fx + fy;
    std::uint32_t u;
    std::memcpy(&u, &z, 4);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    b[i] = static_cast<std::uint16_t>(u >> 16);
  }
}

class MpiStaged final : public NcclGroup {
 public:
  explicit MpiStaged(MPI_Comm comm) {
    mpi_check(MPI_Comm_dup(comm == MPI_COMM_NULL ? MPI_COMM_SELF : comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Op_create(&bf16_sum, 1, &bf16_op_);
  }
  ~MpiStaged() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Op_free(&bf16_op_);
    MPI_Comm_free(&comm_);
  }
  int size() const override { return size_; }
  int rank() const override { return rank_; }

  void reduce_sum(void* buf, std::int64_t count, NcclType type, int root, void* stream) override {
    run([=, this] {
      std::vector<char> h = to_host(buf, count, type, stream), out(h.size());
      mpi_check(MPI_Reduce(h.data(), out.data(), n(count), mpi_type(type), sum_op(type), root, comm_), "MPI_Reduce");
      if (rank_ == root) to_device(buf, out, stream);
    });
  }
  void broadcast(void* buf, std::int64_t count, NcclType type, int root, void* stream) override {
    run([=, this] {
      std::vector<char> h = to_host(buf, count, type, stream);
      mpi_check(MPI_Bcast(h.data(), bytes(count, type), MPI_BYTE, root, comm_), "MPI_Bcast");
      if (rank_ != root) to_device(buf, h, stream);
    });
  }
  void all_reduce_sum(void* buf, std::int64_t count, NcclType type, void* stream) override {
    run([=, this] {
      std::vector<char> h = to_host(buf, count, type, stream), out(h.size());
      mpi_check(MPI_Allreduce(h.data(), out.data(), n(count), mpi_type(type), sum_op(type), comm_), "MPI_Allreduce");
      to_device(buf, out, stream);
    });
  }
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, NcclType type, void* stream) override {
    run([=, this] {
      std::vector<char> h = to_host(send, count * size_, type, stream), out(static_cast<std::size_t>(bytes(count, type)));
      mpi_check(MPI_Reduce_scatter_block(h.data(), out.data(), n(count), mpi_type(type), sum_op(type), comm_),
                "MPI_Reduce_scatter_block");
      to_device(recv, out, stream);
    });
  }
  void all_gather(const void* send, void* recv, std::int64_t count, NcclType type, void* stream) override {
    run([=, this] {
      std::vector<char> h = to_host(send, count, type, stream), out(h.size() * static_cast<std::size_t>(size_));
      mpi_check(MPI_Allgather(h.data(), bytes(count, type), MPI_BYTE, out.data(), bytes(count, type), MPI_BYTE, comm_),
                "MPI_Allgather");
      to_device(recv, out, stream);
    });
  }
  void send(const void* buf, std::int64_t count, NcclType type, int peer, void* stream) override {
    p2p_.push_back({const_cast<void*>(buf), count, type, peer, stream, true});
    if (depth_ == 0) flush();
  }
  void recv(void* buf, std::int64_t count, NcclType type, int peer, void* stream) override {
    p2p_.push_back({buf, count, type, peer, stream, false});
    if (depth_ == 0) flush();
  }
  void group_start() override { ++depth_; }
  void group_end() override {
    if (--depth_ == 0) flush();
  }
  void abort() override {}

 private:
  struct P2p {
    void* buf;
    std::int64_t count;
    NcclType type;
    int peer;
    void* stream;
    bool send;
  };
  static int n(std::int64_t count) {
    if (count > INT_MAX) fail("KEEL_NCCL_OVER_MPI: {} elements in one operation", count);
    return static_cast<int>(count);
  }
  static int bytes(std::int64_t count, NcclType type) {
    return n(count * static_cast<std::int64_t>(elem_size(type)));
  }
  static MPI_Datatype mpi_type(NcclType t) {
    switch (t) {
      case NcclType::kFloat32: return MPI_FLOAT;
      case NcclType::kBfloat16: return MPI_UINT16_T;
      case NcclType::kFloat64: return MPI_DOUBLE;
      case NcclType::kUint32: return MPI_UINT32_T;
    }
    return MPI_FLOAT;
  }
  MPI_Op sum_op(NcclType t) const { return t == NcclType::kBfloat16 ? bf16_op_ : MPI_SUM; }
  static std::vector<char> to_host(const void* d, std::int64_t count, NcclType type, void* stream) {
    std::vector<char> h(static_cast<std::size_t>(bytes(count, type)));
    auto s = static_cast<cudaStream_t>(stream);
    if (!h.empty()) KEEL_CUDA_CHECK(cudaMemcpyAsync(h.data(), d, h.size(), cudaMemcpyDeviceToHost, s));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(s));
    return h;
  }
  static void to_device(void* d, const std::vector<char>& h, void* stream) {
    auto s = static_cast<cudaStream_t>(stream);
    if (!h.empty()) KEEL_CUDA_CHECK(cudaMemcpyAsync(d, h.data(), h.size(), cudaMemcpyHostToDevice, s));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  // Collectives run at once, or at the outermost group_end in their order.
  void run(std::function<void()> op) {
    if (depth_ == 0) return op();
    ops_.push_back(std::move(op));
  }
  void flush() {
    std::vector<std::function<void()>> ops;
    ops.swap(ops_);
    for (auto& op : ops) op();
    std::vector<P2p> p2p;
    p2p.swap(p2p_);
    std::vector<std::vector<char>> host(p2p.size());
    std::vector<MPI_Request> req(p2p.size(), MPI_REQUEST_NULL);
    for (std::size_t i = 0; i < p2p.size(); ++i) {
      const P2p& o = p2p[i];
      if (o.send) {
        host[i] = to_host(o.buf, o.count, o.type, o.stream);
        MPI_Isend(host[i].data(), bytes(o.count, o.type), MPI_BYTE, o.peer, 0, comm_, &req[i]);
      } else {
        host[i].resize(static_cast<std::size_t>(bytes(o.count, o.type)));
        MPI_Irecv(host[i].data(), bytes(o.count, o.type), MPI_BYTE, o.peer, 0, comm_, &req[i]);
      }
    }
    if (!req.empty()) mpi_check(MPI_Waitall(static_cast<int>(req.size()), req.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    for (std::size_t i = 0; i < p2p.size(); ++i)
      if (!p2p[i].send) to_device(p2p[i].buf, host[i], p2p[i].stream);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op bf16_op_ = MPI_OP_NULL;
  int size_ = 1, rank_ = 0, depth_ = 0;
  std::vector<std::function<void()>> ops_;
  std::vector<P2p> p2p_;
};

}  // namespace

std::unique_ptr<NcclGroup> make_nccl_group(MPI_Comm comm) {
  if (nccl_over_mpi()) return std::make_unique<MpiStaged>(comm);
  return std::make_unique<Nccl>(comm);
}

}  // namespace keel::parallel

// `--backend mpi`: the harness on host memory with MPI collectives, one process per rank.
// Useful on CPU clusters, and it lets CI exercise the whole harness without a GPU.
// MPI has no 16-bit float types, so bf16/fp16 reductions use user-defined MPI ops over
// uint16 that add in fp32 and round to nearest even, as the GPU libraries do. MPI has no
// `avg`: it is a sum followed by a local scale by 1/n, included in the timed operation.
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "bench/comm/backend.h"
#include "bench/comm/runner.h"
#include "common/error.h"
#include "common/host.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"

namespace keel::bench {
namespace {

template <DType T>
void sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float s = load_as_float(a, i, T) + load_as_float(b, i, T);
    store_from_float(b, i, T, s);
  }
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using HostBuffer = std::unique_ptr<std::byte, FreeDeleter>;

HostBuffer alloc_host(std::uint64_t bytes) {
  void* p = nullptr;
  const std::uint64_t rounded = std::max<std::uint64_t>(4096, (bytes + 4095) / 4096 * 4096);
  if (posix_memalign(&p, 4096, rounded) != 0 || !p) fail("cannot allocate {} bytes of host memory", bytes);
  return HostBuffer(static_cast<std::byte*>(p));
}

class MpiBackend final : public Backend {
 public:
  MpiBackend() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
    ranks_ = {rank_};
    mpi_check(MPI_Op_create(&sum16<DType::kBF16>, 1, &bf16_sum_), "MPI_Op_create");
    mpi_check(MPI_Op_create(&sum16<DType::kFP16>, 1, &fp16_sum_), "MPI_Op_create");
  }
  ~MpiBackend() override {
    free_group();
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&fp16_sum_);
  }

  std::string name() const override { return "mpi"; }
  int world_size() const override { return world_; }
  const std::vector<int>& local_ranks() const override { return ranks_; }

  std::vector<DeviceDescription> local_devices() const override {
    DeviceDescription d;
    d.rank = rank_;
    d.host = host_name();
    d.name = "cpu (host memory)";
    return {d};
  }

  std::map<std::string, std::string> library_versions() const override {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    std::string v(text, static_cast<size_t>(len));
    if (auto cut = v.find_first_of("\n,"); cut != std::string::npos) v.resize(cut);
    return {{"mpi", v}};
  }

  void form_groups(int group_size, bool all_groups) override {
    free_group();
    const int group = rank_ / group_size;
    const int ngroups = all_groups ? world_ / group_size : 1;
    const bool member = group < ngroups;
    PeerWait wait("MPI_Comm_split (forming the groups)");
    mpi_check(MPI_Comm_split(MPI_COMM_WORLD, member ? group : MPI_UNDEFINED, rank_, &group_comm_), "MPI_Comm_split");
    if (group_comm_ != MPI_COMM_NULL) {
      MPI_Comm_set_errhandler(group_comm_, MPI_ERRORS_RETURN);
      MPI_Comm_rank(group_comm_, &group_rank_);
    }
  }

  std::string memory_problem(const SweepBuffers& need, int ranks_on_host) const override {
    return host_memory_problem(need, ranks_on_host, host_available_bytes(), host_name());
  }

  void reserve(std::uint64_t send_bytes, std::uint64_t recv_bytes) override {
    // The old buffer goes first: growing never holds both (the memory check counts one of each).
    if (send_bytes > send_cap_) {
      send_.reset();
      send_cap_ = 0;
      send_ = alloc_host(send_bytes);
      send_cap_ = send_bytes;
    }
    if (recv_bytes > recv_cap_) {
      recv_.reset();
      recv_cap_ = 0;
      recv_ = alloc_host(recv_bytes);
      recv_cap_ = recv_bytes;
    }
  }

  void measure(const CollectiveCase& c, const TimingPlan& plan, std::vector<RankTiming>* out) override {
    if (group_comm_ == MPI_COMM_NULL) return;
    fill(c, 0x5eedull);  // real data, not zeros: some MPI reductions have zero fast paths
    maybe_hang();
    if (rank_ == error_rank_) fail("injected failure on rank {} (--inject-error)", rank_);
    for (int i = 0; i < plan.warmup; ++i) run(c);
    {
      PeerWait wait("MPI_Barrier (before timing)");
      mpi_check(MPI_Barrier(group_comm_), "MPI_Barrier");
    }
    RankTiming t;
    t.rank = rank_;
    t.iter_seconds.resize(static_cast<size_t>(plan.iters));
    const double start = MPI_Wtime();
    for (int i = 0; i < plan.iters; ++i) {
      const double t0 = MPI_Wtime();
      run(c);
      t.iter_seconds[static_cast<size_t>(i)] = MPI_Wtime() - t0;
    }
    t.seconds_per_op = (MPI_Wtime() - start) / plan.iters;
    out->push_back(std::move(t));
  }

  void check(const CollectiveCase& c, std::uint64_t seed, double, std::vector<RankCheck>* out) override {
    if (group_comm_ == MPI_COMM_NULL) return;
    fill(c, seed);
    run(c);
    if (rank_ == corrupt_rank_)
      store_from_float(const_cast<std::byte*>(output_location(c)), corrupt_index(c.shape.recv_count), c.dtype,
                       kCorruptValue);
    const ValueSpec v = make_value_spec(seed, c.nranks, c.dtype);
    const CaseGeometry g = geometry_of(c);
    const std::byte* result = output_location(c);
    RankCheck rc;
    rc.rank = rank_;
    for (std::uint64_t j = 0; j < c.shape.recv_count; ++j) {
      const float got = load_as_float(result, j, c.dtype);
      const float want = expected_output(v, g, group_rank_, j);
      const float diff = got > want ? got - want : want - got;
      if (!(diff <= tolerance(g, c.dtype, want))) {
        if (rc.wrong++ == 0) {
          rc.first_wrong = static_cast<std::int64_t>(j);
          rc.got = got;
          rc.expected = want;
        }
      }
    }
    out->push_back(rc);
  }

 private:
  MPI_Datatype mpi_type(DType t) const { return t == DType::kFP32 ? MPI_FLOAT : MPI_UINT16_T; }
  MPI_Op mpi_sum(DType t) const {
    return t == DType::kFP32 ? MPI_SUM : t == DType::kBF16 ? bf16_sum_ : fp16_sum_;
  }

  // Where a rank's input lives: the send buffer, or inside the receive buffer in place.
  std::byte* input_location(const CollectiveCase& c) {
    if (!c.in_place) return send_.get();
    if (c.op == Collective::kAllGather)
      return recv_.get() + static_cast<std::uint64_t>(group_rank_) * c.shape.send_count * dtype_size(c.dtype);
    if (c.op == Collective::kReduceScatter) return send_.get();  // MPI_IN_PLACE reads the full vector from recvbuf
    return recv_.get();
  }
  // MPI's in-place reduce-scatter leaves the result at the start of the full vector.
  const std::byte* output_location(const CollectiveCase& c) const {
    if (c.in_place && c.op == Collective::kReduceScatter) return send_.get();
    return recv_.get();
  }

  void fill(const CollectiveCase& c, std::uint64_t seed) {
    const ValueSpec v = make_value_spec(seed, c.nranks, c.dtype);
    std::memset(recv_.get(), 0xff, c.shape.recv_count * dtype_size(c.dtype));  // NaN poison
    if (c.in_place && c.op == Collective::kReduceScatter)
      std::memset(send_.get(), 0xff, c.shape.send_count * dtype_size(c.dtype));
    std::byte* in = input_location(c);
    for (std::uint64_t i = 0; i < c.shape.send_count; ++i) store_from_float(in, i, c.dtype, input_value(v, group_rank_, i));
  }

  void maybe_hang() {
    if (hang_rank_ == rank_) hang_forever();
  }

  void run(const CollectiveCase& c) {
    PeerWait wait("the MPI collective being measured");
    const MPI_Datatype type = mpi_type(c.dtype);
    const int n = c.nranks;
    const auto count = [](std::uint64_t v) {
      if (v > static_cast<std::uint64_t>(INT32_MAX)) fail("message of {} elements exceeds MPI's int count", v);
      return static_cast<int>(v);
    };
    std::byte* send = send_.get();
    std::byte* recv = recv_.get();
    switch (c.op) {
      case Collective::kAllReduce:
        mpi_check(MPI_Allreduce(c.in_place ? MPI_IN_PLACE : send, recv, count(c.shape.recv_count), type,
                                mpi_sum(c.dtype), group_comm_),
                  "MPI_Allreduce");
        break;
      case Collective::kReduceScatter:
        mpi_check(MPI_Reduce_scatter_block(c.in_place ? MPI_IN_PLACE : send, c.in_place ? send : recv,
                                           count(c.shape.recv_count), type, mpi_sum(c.dtype), group_comm_),
                  "MPI_Reduce_scatter_block");
        break;
      case Collective::kAllGather:
        mpi_check(MPI_Allgather(c.in_place ? MPI_IN_PLACE : send, count(c.shape.send_count), type, recv,
                                count(c.shape.send_count), type, group_comm_),
                  "MPI_Allgather");
        break;
      case Collective::kBroadcast:
        // MPI broadcasts in place; out-of-place copies the root's input first, as NCCL does.
        if (!c.in_place && group_rank_ == c.root) std::memcpy(recv, send, c.shape.send_count * dtype_size(c.dtype));
        mpi_check(MPI_Bcast(recv, count(c.shape.recv_count), type, c.root, group_comm_), "MPI_Bcast");
        break;
      case Collective::kAllToAll: {
        const int block = count(c.shape.send_count / static_cast<std::uint64_t>(n));
        mpi_check(MPI_Alltoall(send, block, type, recv, block, type, group_comm_), "MPI_Alltoall");
        break;
      }
      case Collective::kSendRecv:
        mpi_check(MPI_Sendrecv(send, count(c.shape.send_count), type, (group_rank_ + 1) % n, 7, recv,
                               count(c.shape.recv_count), type, (group_rank_ - 1 + n) % n, 7, group_comm_,
                               MPI_STATUS_IGNORE),
                  "MPI_Sendrecv");
        break;
    }
    if (c.redop == RedOp::kAvg && collective_reduces(c.op)) {
      std::byte* out = c.in_place && c.op == Collective::kReduceScatter ? send : recv;
      const float inv = static_cast<float>(n);
      for (std::uint64_t i = 0; i < c.shape.recv_count; ++i)
        store_from_float(out, i, c.dtype, load_as_float(out, i, c.dtype) / inv);
    }
  }

  void free_group() {
    if (group_comm_ != MPI_COMM_NULL) MPI_Comm_free(&group_comm_);
    group_comm_ = MPI_COMM_NULL;
  }

  int rank_ = 0, world_ = 1, group_rank_ = 0;
  std::vector<int> ranks_;
  MPI_Comm group_comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, fp16_sum_ = MPI_OP_NULL;
  HostBuffer send_, recv_;
  std::uint64_t send_cap_ = 0, recv_cap_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_mpi_backend() { return std::make_unique<MpiBackend>(); }

}  // namespace keel::bench

#include "parallel/data_parallel_comm.h"

#include <climits>
#include <cstring>

#include "common/dtype.h"
#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {
namespace {

// MPI counts are ints: shards past 2^31 floats belong on the GPU path (NCCL takes size_t).
std::vector<int> int_counts(const std::vector<std::int64_t>& bounds, int size) {
  if (static_cast<int>(bounds.size()) != size + 1)
    fail("data parallel: {} shard bounds for a group of {} ranks", bounds.size(), size);
  std::vector<int> counts(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    const std::int64_t n = bounds[r + 1] - bounds[r];
    if (n < 0 || n > INT_MAX) fail("data parallel: shard {} of {} floats does not fit an MPI count", r, n);
    counts[static_cast<std::size_t>(r)] = static_cast<int>(n);
  }
  return counts;
}

// x rounded to bf16 and back, in place, over [begin, end).
void round_to_bf16(float* x, std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) x[i] = bf16_round(x[i]);
}

class MpiDataParallelComm final : public DataParallelComm {
 public:
  MpiDataParallelComm(MPI_Comm comm, GradReduceDtype reduce) : comm_(comm), bf16_(reduce == GradReduceDtype::kBf16) {
    mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  }
  int size() const override { return size_; }
  int rank() const override { return rank_; }

  void reduce_scatter_sum(float* buf, const std::vector<std::int64_t>& bounds) override {
    const std::vector<int> counts = int_counts(bounds, size_);
    // MPI_IN_PLACE would put the result at the start of buf; the shard belongs at its offset.
    recv_.resize(static_cast<std::size_t>(counts[static_cast<std::size_t>(rank_)]));
    if (bf16_) round_to_bf16(buf, bounds.front(), bounds.back());  // what each rank would send
    {
      PeerWait wait("MPI_Reduce_scatter (gradients)");
      mpi_check(MPI_Reduce_scatter(buf + bounds.front(), recv_.data(), counts.data(), MPI_FLOAT, MPI_SUM, comm_),
                "MPI_Reduce_scatter (gradients)");
    }
    if (bf16_) round_to_bf16(recv_.data(), 0, static_cast<std::int64_t>(recv_.size()));  // the sum as it would land
    if (!recv_.empty()) std::memcpy(buf + bounds[rank_], recv_.data(), recv_.size() * sizeof(float));
  }

  void all_gather(float* buf, const std::vector<std::int64_t>& bounds) override {
    const std::vector<int> counts = int_counts(bounds, size_);
    std::vector<int> displs(counts.size());
    for (int r = 0; r < size_; ++r) {
      if (bounds[r] - bounds.front() > INT_MAX) fail("data parallel: shard offset {} does not fit an MPI displacement", bounds[r]);
      displs[static_cast<std::size_t>(r)] = static_cast<int>(bounds[r] - bounds.front());
    }
    PeerWait wait("MPI_Allgatherv (parameters)");
    mpi_check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf + bounds.front(), counts.data(), displs.data(),
                             MPI_FLOAT, comm_),
              "MPI_Allgatherv (parameters)");
  }

  void all_reduce_sum(double* x, int n) override {
    PeerWait wait("MPI_Allreduce (gradient norm)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, comm_), "MPI_Allreduce");
  }

 private:
  MPI_Comm comm_;
  bool bf16_ = false;
  int size_ = 1, rank_ = 0;
  std::vector<float> recv_;
};

}  // namespace

#ifndef KEEL_HAVE_CUDA
std::unique_ptr<DataParallelComm> make_nccl_data_parallel_comm(std::shared_ptr<NcclGroup>, void*, GradReduceDtype) {
  fail("data parallelism on GPUs: this keel was built without CUDA");
}
std::unique_ptr<NcclGroup> make_nccl_group(MPI_Comm) { fail("NCCL: this keel was built without CUDA"); }
#endif

std::unique_ptr<DataParallelComm> make_mpi_data_parallel_comm(MPI_Comm comm, GradReduceDtype reduce) {
  return std::make_unique<MpiDataParallelComm>(comm, reduce);
}

}  // namespace keel::parallel

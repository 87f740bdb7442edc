// The collectives data parallelism (ZeRO-1) needs, on the memory a training backend keeps its
// flat buffers in: host memory through MPI (the CPU backend, CPU-rank tests in CI) or device
// memory through NCCL on the backend's stream (data_parallel_comm_nccl_cuda.cc). The ZeRO-1
// step is written once against this interface.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/nccl_group.h"

namespace keel::parallel {

// The element type gradients are summed in over the data-parallel ranks (`parallel.grad_reduce`).
// kFp32 (default): a run on N ranks matches one rank within fp32 summation order. kBf16 halves
// the bytes every gradient reduction moves, at bf16's precision (8 significant bits): each
// rank's gradients are rounded to bf16 (round to nearest even), summed, and the sum rounded to
// bf16 again before it lands, widened, in the fp32 gradient shard. NCCL also rounds the partial
// sums it passes along its ring; at 2 ranks that is the same single rounding, so the GPU and
// CPU paths agree bit for bit there, and above 2 within the rounding of the partial sums.
enum class GradReduceDtype { kFp32, kBf16 };

class DataParallelComm {
 public:
  virtual ~DataParallelComm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // Floats the flat buffers handed to reduce_scatter_sum() and all_gather() must hold for a
  // region of `total` floats (at least the total; NCCL's equal-chunk collectives want a multiple
  // of the group size): a region [b, e) needs b + buffer_floats(e - b).
  virtual std::int64_t buffer_floats(std::int64_t total) const { return total; }
  // `buf` is the whole flat buffer on every rank; `bounds` (size() + 1 offsets) the shards of
  // the region [bounds.front(), bounds.back()). Afterwards this rank's shard [bounds[rank],
  // bounds[rank + 1]) holds the element-wise sum over the group, in the precision the comm was
  // made with (GradReduceDtype); the rest of the region is unspecified, buf outside it as it was.
  virtual void reduce_scatter_sum(float* buf, const std::vector<std::int64_t>& bounds) = 0;
  // Afterwards every shard of buf holds its owner's values, on every rank.
  virtual void all_gather(float* buf, const std::vector<std::int64_t>& bounds) = 0;
  // Sums n doubles in place over the group.
  virtual void all_reduce_sum(double* x, int n) = 0;
  // GPU memory the comm holds of its own (the bf16 copy of a kBf16 reduction), for the memory
  // a backend reports.
  virtual std::size_t device_bytes() const { return 0; }
};

// Host buffers, over an MPI communicator (not owned; it must outlive the object). With kBf16 the
// rounding is done on the host around an fp32 MPI sum.
std::unique_ptr<DataParallelComm> make_mpi_data_parallel_comm(MPI_Comm comm,
                                                              GradReduceDtype reduce = GradReduceDtype::kFp32);

// Device buffers on the current GPU, through the NCCL communicator `group` (parallel::Mesh::nccl
// of the data group), enqueued on `stream` (a cudaStream_t); nothing synchronizes the host. With
// kBf16 the reduce-scatter runs on a bf16 copy of the buffer (2 bytes per float, allocated at the
// first reduction). Throws keel::Error in a build without CUDA.
std::unique_ptr<DataParallelComm> make_nccl_data_parallel_comm(std::shared_ptr<NcclGroup> group, void* stream,
                                                               GradReduceDtype reduce = GradReduceDtype::kFp32);

}  // namespace keel::parallel

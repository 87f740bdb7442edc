// DataParallelComm over NCCL on device buffers. NCCL's reduce-scatter and all-gather take equal
// counts, and uneven ones built from grouped reduces / broadcasts run well below their
// bandwidth, so the collectives run on equal chunks of the buffer (chunk c = [c S, (c+1) S),
// S = ceil(total / ranks) rounded up to 64 floats; the buffers hold ranks x S floats) and the
// few floats where a ZeRO-1 shard and its rank's chunk differ (at most half a matrix at each cut,
// zero1.h) move point to point:
//   reduce_scatter_sum: in-place ncclReduceScatter, then each chunk holder sends the summed
//     floats of other ranks' shards inside its chunk to their owners;
//   all_gather: each owner first sends its updated floats that lie in another rank's chunk to
//     that chunk's holder, then in-place ncclAllGather.
// With bf16 gradient reduction the reduce-scatter runs in place on a bf16 copy of the buffer and
// the chunk is widened back into buf before the (fp32) exchange. The bounds may describe a
// region of the buffer (expert parallelism's expert region, after the replicated one): the
// chunks then start at bounds.front(), and the padding past the region's end, which may hold
// another region's floats, is kept as it was.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/error.h"
#include "common/mpi_session.h"
#include "device/cuda_check.h"
#include "device/device_buffer.h"
#include "ops/cuda/cast.h"
#include "parallel/data_parallel_comm.h"
#include "parallel/nccl_group.h"
#include "parallel/zero1.h"

namespace keel::parallel {
namespace {

class NcclDataParallelComm final : public DataParallelComm {
 public:
  NcclDataParallelComm(std::shared_ptr<NcclGroup> group, cudaStream_t stream, GradReduceDtype reduce)
      : stream_(stream), bf16_(reduce == GradReduceDtype::kBf16), g_(std::move(group)), size_(g_->size()),
        rank_(g_->rank()) {}
  int size() const override { return size_; }
  int rank() const override { return rank_; }

  std::int64_t buffer_floats(std::int64_t total) const override { return chunk(total) * size_; }

  void reduce_scatter_sum(float* buf, const std::vector<std::int64_t>& bounds) override {
    const Region r = region_of(buf, bounds);
    const std::int64_t s = r.chunk;
    float* b = r.base;
    keep_tail(r);
    // in place: the whole region in, this rank's chunk out at its own offset
    if (bf16_) {
      auto* h = static_cast<ops::cuda::bf16*>(
          scratch_.ensure(static_cast<std::size_t>(s * size_) * sizeof(ops::cuda::bf16), stream_, "bf16 gradients"));
      ops::cuda::f32_to_bf16(b, h, s * size_, stream_);
      g_->reduce_scatter_sum(h, h + rank_ * s, s, NcclType::kBfloat16, stream_);
      ops::cuda::bf16_to_f32(h + rank_ * s, b + rank_ * s, s, stream_);
    } else {
      g_->reduce_scatter_sum(b, b + rank_ * s, s, NcclType::kFloat32, stream_);
    }
    // holder (chunk) -> owner (shard)
    exchange(b, r.bounds, s, /*to_owner=*/true);
    restore_tail(r);
  }

  void all_gather(float* buf, const std::vector<std::int64_t>& bounds) override {
    const Region r = region_of(buf, bounds);
    keep_tail(r);
    exchange(r.base, r.bounds, r.chunk, /*to_owner=*/false);
    g_->all_gather(r.base + rank_ * r.chunk, r.base, r.chunk, NcclType::kFloat32, stream_);
    restore_tail(r);
  }

  void all_reduce_sum(double* x, int n) override {
    g_->all_reduce_sum(x, n, NcclType::kFloat64, stream_);
  }

  std::size_t device_bytes() const override { return scratch_.capacity(); }

 private:
  std::int64_t chunk(std::int64_t total) const {
    const std::int64_t s = (total + size_ - 1) / size_;
    return (s + kZero1AlignFloats - 1) / kZero1AlignFloats * kZero1AlignFloats;
  }
  // A region [bounds.front(), bounds.back()) of the buffer: its start, its shard bounds relative
  // to it, its chunk, and its padded tail [len, chunk x ranks) (relative), which the equal-chunk
  // collectives write and keep_tail / restore_tail preserve: a tail may be another region's
  // floats (expert parallelism: the replicated region is followed by the expert region).
  struct Region {
    float* base = nullptr;
    std::vector<std::int64_t> bounds;
    std::int64_t chunk = 0, len = 0, padded = 0;
  };
  Region region_of(float* buf, const std::vector<std::int64_t>& bounds) const {
    if (static_cast<int>(bounds.size()) != size_ + 1 || bounds.front() < 0 || bounds.back() < bounds.front())
      fail("data parallel: {} shard bounds for a group of {} ranks", bounds.size(), size_);
    Region r;
    r.base = buf + bounds.front();
    for (std::int64_t b : bounds) r.bounds.push_back(b - bounds.front());
    r.len = r.bounds.back();
    r.chunk = chunk(r.len);
    r.padded = r.chunk * size_;
    return r;
  }
  void keep_tail(const Region& r) {
    if (r.padded == r.len) return;
    auto* t = static_cast<float*>(tail_.ensure(static_cast<std::size_t>(r.padded - r.len) * sizeof(float), stream_, "tail"));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(t, r.base + r.len, static_cast<std::size_t>(r.padded - r.len) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream_));
  }
  void restore_tail(const Region& r) {
    if (r.padded == r.len) return;
    KEEL_CUDA_CHECK(cudaMemcpyAsync(r.base + r.len, tail_.get(), static_cast<std::size_t>(r.padded - r.len) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream_));
  }

  // The floats of shard `owner` inside chunk `holder`: [lo, hi).
  static std::pair<std::int64_t, std::int64_t> overlap(const std::vector<std::int64_t>& bounds, int owner, int holder,
                                                       std::int64_t s) {
    const std::int64_t lo = std::max(bounds[owner], holder * s);
    const std::int64_t hi = std::min(bounds[owner + 1], (holder + 1) * s);
    return {lo, std::max(lo, hi)};
  }

  void exchange(float* buf, const std::vector<std::int64_t>& bounds, std::int64_t s, bool to_owner) {
    g_->group_start();
    for (int other = 0; other < size_; ++other) {
      if (other == rank_) continue;
      // what this rank holds of other's shard, and what other holds of this rank's shard
      const auto [alo, ahi] = overlap(bounds, other, rank_, s);  // in my chunk, owned by other
      const auto [blo, bhi] = overlap(bounds, rank_, other, s);  // in other's chunk, owned by me
      if (to_owner) {
        if (ahi > alo) g_->send(buf + alo, ahi - alo, NcclType::kFloat32, other, stream_);
        if (bhi > blo) g_->recv(buf + blo, bhi - blo, NcclType::kFloat32, other, stream_);
      } else {
        if (bhi > blo) g_->send(buf + blo, bhi - blo, NcclType::kFloat32, other, stream_);
        if (ahi > alo) g_->recv(buf + alo, ahi - alo, NcclType::kFloat32, other, stream_);
      }
    }
    g_->group_end();
  }

  cudaStream_t stream_;
  bool bf16_ = false;
  GrowingDeviceBuffer scratch_{"out of GPU memory: the ", "train on more GPUs, a smaller model or parallel.grad_reduce: fp32"};
  GrowingDeviceBuffer tail_{"out of GPU memory: the data-parallel region's ", "train on more GPUs or a smaller model"};
  std::shared_ptr<NcclGroup> g_;
  int size_ = 1, rank_ = 0;
};

}  // namespace

std::unique_ptr<DataParallelComm> make_nccl_data_parallel_comm(std::shared_ptr<NcclGroup> group, void* stream,
                                                               GradReduceDtype reduce) {
  return std::make_unique<NcclDataParallelComm>(std::move(group), static_cast<cudaStream_t>(stream), reduce);
}

}  // namespace keel::parallel

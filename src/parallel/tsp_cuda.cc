#include "parallel/tsp_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "blocks/cuda/kernels.h"
#include "common/error.h"
#include "device/cuda_check.h"
#include "device/device_buffer.h"
#include "parallel/tsp.h"

namespace keel::parallel {

namespace {
constexpr std::size_t kAlign = 256;
std::size_t aligned(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void CudaTspBoundary::exit(bf16* partial, bf16* y, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {
  if (!first_) blocks::cuda::add_bf16(y, partial, y, tokens * width, stream);
}

void CudaTspBoundary::enter_backward(float* partial, float* dx, std::int64_t tokens, std::int64_t width,
                                     cudaStream_t stream) {
  if (!first_) blocks::cuda::add_f32(dx, partial, dx, tokens * width, stream);
}

void CudaTspBoundary::enter_backward(bf16* partial, bf16* dx, std::int64_t tokens, std::int64_t width,
                                     cudaStream_t stream) {
  if (!first_) blocks::cuda::add_bf16(dx, partial, dx, tokens * width, stream);
}

CudaTspShards::CudaTspShards(std::shared_ptr<NcclGroup> side, std::shared_ptr<NcclGroup> group, std::int64_t tokens,
                             std::int64_t hidden)
    : side_(std::move(side)), group_(std::move(group)) {
  if (!side_ || !group_) fail("tsp (cuda): no tsp group");
  const std::size_t nd = static_cast<std::size_t>(tokens * hidden);
  const std::size_t b16 = aligned(nd * sizeof(bf16));
  const std::size_t bytes = b16 + aligned(nd * sizeof(float));
  if (cudaMalloc(&tmp_, bytes) != cudaSuccess)
    throw_out_of_gpu_memory("out of GPU memory: TSP's partial-output buffers", bytes,
                            "lower batch.micro_batch or data.seq_length, or raise parallel.tsp");
  shard_bytes_ = bytes;
  auto* at = static_cast<std::byte*>(tmp_);
  tmp_f32_ = reinterpret_cast<float*>(at + b16);
  boundary_ = std::make_unique<CudaTspBoundary>(reinterpret_cast<bf16*>(at), tmp_f32_);
  KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
  for (cudaEvent_t* e :
       {&start_, &done_, &ready_[0], &ready_[1], &free_[0], &free_[1], &reduced_[0], &reduced_[1], &ring_})
    KEEL_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
}

CudaTspShards::~CudaTspShards() {
  if (comm_) cudaStreamSynchronize(comm_);
  for (cudaEvent_t e : {start_, done_, ready_[0], ready_[1], free_[0], free_[1], reduced_[0], reduced_[1], ring_})
    if (e) cudaEventDestroy(e);
  if (comm_) cudaStreamDestroy(comm_);
  if (mem_) cudaFree(mem_);
  if (tmp_) cudaFree(tmp_);
}

void CudaTspShards::bind(const model::ModelConfig& cfg, const optim::ParamLayout& layout, const float* params,
                         const bf16* params_bf16, float* grads) {
  if (mem_) fail("tsp (cuda): bind() twice");
  params_ = params, params_bf16_ = params_bf16, grads_ = grads;
  // Which parameters the blocks read in bf16 (the GEMM operands) and which in fp32.
  std::map<std::int64_t, bool> reads_bf16;  // by offset
  blocks::cuda::device_weights(
      cfg, layout,
      [&](const optim::ParamInfo& p) { return reads_bf16[p.offset] = false, params + p.offset; },
      [&](const optim::ParamInfo& p) { return reads_bf16[p.offset] = true, params_bf16 + p.offset; });
  const int layers = cfg.layers;
  units_.assign(static_cast<std::size_t>(layers) * 2, Unit{});
  std::map<std::int64_t, const Slice*> sliced;  // by offset
  const TspSizes sizes = tsp_sizes(layout, layers);
  for (const auto& p : layout.params) {
    const int i = tsp_unit(p, layers);
    if (i >= 2 * layers) {  // a vocabulary table: this rank's rows, the same count on every rank
      Table& t = i == 2 * layers ? embed_ : head_;
      t.offset = p.offset, t.rows = p.shape.front(), t.width = p.shape.back(), t.piece_rows = sizes.piece_rows;
      continue;
    }
    if (i < 0) continue;  // replicated: read in place
    Unit& u = units_[static_cast<std::size_t>(i)];
    Slice s;
    s.numel = p.numel, s.offset = p.offset, s.bf16 = reads_bf16.at(p.offset);
    s.at = u.bytes, s.grad_at = u.grad_floats;
    u.bytes += aligned(static_cast<std::size_t>(p.numel) * (s.bf16 ? sizeof(bf16) : sizeof(float)));
    u.grad_floats += static_cast<std::int64_t>(aligned(static_cast<std::size_t>(p.numel) * sizeof(float)) / sizeof(float));
    u.slices.push_back(s);
  }
  // the buffers hold a sub-block's shard or a table piece (bf16 weights, fp32 gradients)
  std::size_t wmost = aligned(static_cast<std::size_t>(sizes.piece_rows * std::max(embed_.width, head_.width)) * sizeof(bf16));
  std::int64_t gmost = sizes.piece_rows * std::max(embed_.width, head_.width);
  for (Unit& u : units_) {
    wmost = std::max(wmost, u.bytes), gmost = std::max(gmost, u.grad_floats);
    for (const Slice& s : u.slices) sliced[s.offset] = &s;
  }
  const std::size_t gbytes = aligned(static_cast<std::size_t>(gmost) * sizeof(float));
  const std::size_t bytes = 2 * wmost + 3 * gbytes;
  if (bytes > 0 && cudaMalloc(&mem_, bytes) != cudaSuccess)
    throw_out_of_gpu_memory("out of GPU memory: TSP's weight and gradient shard buffers", bytes,
                            "train on more GPUs (parallel.tsp) or a smaller model");
  shard_bytes_ += bytes;
  auto* at = static_cast<std::byte*>(mem_);
  for (int b = 0; b < 2; ++b) {
    wbuf_[b] = at, at += wmost;
    gbuf_[b] = reinterpret_cast<float*>(at), at += gbytes;
  }
  ring_g_ = reinterpret_cast<float*>(at);
  own_w_ = blocks::cuda::device_weights(
      cfg, layout, [&](const optim::ParamInfo& p) { return params + p.offset; },
      [&](const optim::ParamInfo& p) { return params_bf16 + p.offset; });
  own_g_ = blocks::cuda::device_grads(cfg, layout, grads);
  for (int b = 0; b < 2; ++b) {
    auto in_buf = [&](const optim::ParamInfo& p) -> const std::byte* {
      const auto it = sliced.find(p.offset);
      return it == sliced.end() ? nullptr : wbuf_[b] + it->second->at;
    };
    buf_w_[b] = blocks::cuda::device_weights(
        cfg, layout,
        [&](const optim::ParamInfo& p) {
          const std::byte* q = in_buf(p);
          return q ? reinterpret_cast<const float*>(q) : params + p.offset;
        },
        [&](const optim::ParamInfo& p) {
          const std::byte* q = in_buf(p);
          return q ? reinterpret_cast<const bf16*>(q) : params_bf16 + p.offset;
        });
    buf_g_[b] = blocks::cuda::device_grads(cfg, layout, [&](const optim::ParamInfo& p) {
      const auto it = sliced.find(p.offset);
      return it == sliced.end() ? grads + p.offset : gbuf_[b] + it->second->grad_at;
    });
  }
}

void CudaTspShards::post(const Unit& u, int shard, int buf) {
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, free_[buf], 0));
  const bool root = shard == rank();
  side_->group_start();
  for (const Slice& s : u.slices) {
    void* p = root ? (s.bf16 ? const_cast<void*>(static_cast<const void*>(params_bf16_ + s.offset))
                             : const_cast<void*>(static_cast<const void*>(params_ + s.offset)))
                   : static_cast<void*>(wbuf_[buf] + s.at);
    side_->broadcast(p, s.numel, s.bf16 ? NcclType::kBfloat16 : NcclType::kFloat32, shard, comm_);
  }
  side_->group_end();
  KEEL_CUDA_CHECK(cudaEventRecord(ready_[buf], comm_));
}

void CudaTspShards::reduce(const Unit& u, int shard, int buf) {
  const bool root = shard == rank();
  side_->group_start();
  for (const Slice& s : u.slices)
    side_->reduce_sum(root ? grads_ + s.offset : gbuf_[buf] + s.grad_at, s.numel, NcclType::kFloat32, shard, comm_);
  side_->group_end();
  KEEL_CUDA_CHECK(cudaEventRecord(reduced_[buf], comm_));
}

void CudaTspShards::sweep(const Unit& u, cudaStream_t stream, bool backward,
                          const std::function<void(int, int, bool)>& fn) {
  if (!mem_) fail("tsp (cuda): a sweep before bind()");
  const int D = size();
  // The side stream starts after the model stream's work so far (the optimizer's updates of
  // the weights it broadcasts, the previous use of the buffers).
  KEEL_CUDA_CHECK(cudaEventRecord(start_, stream));
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, start_, 0));
  post(u, 0, 0);
  for (int r = 0; r < D; ++r) {
    const int b = r % 2;
    first_ = r == 0;
    if (r + 1 < D) post(u, r + 1, (r + 1) % 2);  // prefetched while shard r computes
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, ready_[b], 0));
    const bool own = r == rank();
    if (backward && !own) {
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, reduced_[b], 0));  // shard r - 2's sum has left it
      KEEL_CUDA_CHECK(cudaMemsetAsync(gbuf_[b], 0, static_cast<std::size_t>(u.grad_floats) * sizeof(float), stream));
    }
    fn(r, b, own);
    KEEL_CUDA_CHECK(cudaEventRecord(free_[b], stream));
    if (backward) {
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, free_[b], 0));
      reduce(u, r, b);
    }
  }
  first_ = true;
  KEEL_CUDA_CHECK(cudaEventRecord(done_, comm_));
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, done_, 0));
}

void CudaTspShards::pass_weights(const Unit& u, bool own, int from_buf, int to_buf) {
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, free_[to_buf], 0));  // its last pass is done with it
  const int D = size(), next = (rank() + 1) % D, prev = (rank() + D - 1) % D;
  side_->group_start();
  for (const Slice& s : u.slices) {
    const NcclType type = s.bf16 ? NcclType::kBfloat16 : NcclType::kFloat32;
    const void* from = !own  ? static_cast<const void*>(wbuf_[from_buf] + s.at)
                       : s.bf16 ? static_cast<const void*>(params_bf16_ + s.offset)
                                : static_cast<const void*>(params_ + s.offset);
    side_->send(from, s.numel, type, next, comm_);
    side_->recv(wbuf_[to_buf] + s.at, s.numel, type, prev, comm_);
  }
  side_->group_end();
  KEEL_CUDA_CHECK(cudaEventRecord(ready_[to_buf], comm_));
}

void CudaTspShards::pass_grads(const Unit& u, int buf) {
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, free_[buf], 0));  // its sum so far is complete
  const int D = size(), next = (rank() + 1) % D, prev = (rank() + D - 1) % D;
  side_->group_start();
  side_->send(gbuf_[buf], u.grad_floats, NcclType::kFloat32, next, comm_);
  side_->recv(ring_g_, u.grad_floats, NcclType::kFloat32, prev, comm_);
  side_->group_end();
  KEEL_CUDA_CHECK(cudaEventRecord(reduced_[buf], comm_));
  KEEL_CUDA_CHECK(cudaEventRecord(ring_, comm_));
}

void CudaTspShards::ring_sweep(const Unit& u, cudaStream_t stream, bool backward,
                               const std::function<void(int, int, bool)>& fn) {
  if (!mem_) fail("tsp (cuda): a sweep before bind()");
  const int D = size(), s = rank();
  const std::size_t gbytes = static_cast<std::size_t>(u.grad_floats) * sizeof(float);
  KEEL_CUDA_CHECK(cudaEventRecord(start_, stream));
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, start_, 0));
  for (int k = 0; k < D; ++k) {
    // step k: shard s - k, in buffer k % 2 (k = 0: this rank's own, in place)
    const int b = k % 2, shard = (s - k + D) % D;
    if (k + 1 < D) pass_weights(u, k == 0, b, (k + 1) % 2);  // passed on, the next received, while this computes
    if (k > 0) KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, ready_[b], 0));
    if (backward && k > 0) {
      // shard s - k's gradients start here (k = 1) or arrive from rank s - 1 (in ring_g_):
      // this rank's share goes to a zeroed buffer, once its send of two steps ago has left it
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, reduced_[b], 0));
      KEEL_CUDA_CHECK(cudaMemsetAsync(gbuf_[b], 0, gbytes, stream));
    }
    first_ = k == 0;
    fn(shard, b, k == 0);
    if (backward && k > 1) {
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, ring_, 0));
      blocks::cuda::add_f32(gbuf_[b], ring_g_, gbuf_[b], u.grad_floats, stream);
    }
    KEEL_CUDA_CHECK(cudaEventRecord(free_[b], stream));
    if (backward && k > 0) pass_grads(u, b);  // on to rank s + 1 (shard s - k's rank after the last)
  }
  if (backward && D > 1) {
    // the other ranks' sum of this rank's shard, after its own pass wrote its gradients
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, ring_, 0));
    for (const Slice& sl : u.slices)
      blocks::cuda::add_f32(grads_ + sl.offset, ring_g_ + sl.grad_at, grads_ + sl.offset, sl.numel, stream);
  }
  first_ = true;
  KEEL_CUDA_CHECK(cudaEventRecord(done_, comm_));
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, done_, 0));
}

void CudaTspShards::forward(int layer, Part part, cudaStream_t stream, const Forward& fn) {
  const std::size_t l = static_cast<std::size_t>(layer);
  const Unit& u = units_.at(l * 2 + (part == Part::kMlp ? 1 : 0));
  const auto each = [&](int r, int b, bool own) { fn(r, own ? own_w_.layers[l] : buf_w_[b].layers[l]); };
  if (part == Part::kMlp) return ring_sweep(u, stream, false, each);
  sweep(u, stream, false, each);
}

void CudaTspShards::backward(int layer, Part part, cudaStream_t stream, const Backward& fn) {
  const std::size_t l = static_cast<std::size_t>(layer);
  const Unit& u = units_.at(l * 2 + (part == Part::kMlp ? 1 : 0));
  const auto each = [&](int r, int b, bool own) {
    fn(r, own ? own_w_.layers[l] : buf_w_[b].layers[l], own ? own_g_.layers[l] : buf_g_[b].layers[l]);
  };
  if (part == Part::kMlp) return ring_sweep(u, stream, true, each);
  sweep(u, stream, true, each);
}

void CudaTspShards::table_sweep(Part table, cudaStream_t stream, bool backward, const TableFn& fn) {
  const Table& t = table == Part::kHead && head_.rows > 0 ? head_ : embed_;
  if (t.rows == 0) fail("tsp (cuda): no vocabulary table split over the group");
  for (int k = 0; k < t.pieces(); ++k) {
    const std::int64_t skip = k * t.piece_rows, rows = std::min(t.piece_rows, t.rows - skip);
    Unit u;  // piece k of every rank's rows: the same offsets in every rank's layout
    Slice sl;
    sl.numel = rows * t.width, sl.offset = t.offset + skip * t.width, sl.bf16 = true;
    u.slices.push_back(sl);
    u.bytes = aligned(static_cast<std::size_t>(sl.numel) * sizeof(bf16));
    u.grad_floats = sl.numel;
    sweep(u, stream, backward, [&](int r, int b, bool own) {
      const bf16* w = own ? params_bf16_ + sl.offset : reinterpret_cast<const bf16*>(wbuf_[b]);
      float* g = !backward ? nullptr : own ? grads_ + sl.offset : gbuf_[b];
      fn(r, t.rows * r + skip, rows, w, g);
    });
  }
}

void CudaTspShards::forward(Part table, cudaStream_t stream, const TableFn& fn) { table_sweep(table, stream, false, fn); }

void CudaTspShards::backward(Part table, cudaStream_t stream, const TableFn& fn) { table_sweep(table, stream, true, fn); }

}  // namespace keel::parallel

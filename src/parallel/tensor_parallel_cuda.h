// Megatron tensor parallelism on GPUs, with sequence parallelism as an option: the GPU twin of
// tensor_parallel.h (read that first: the math, the placements and which gradients are partial
// are the same). The runner every block gets from the plan (plan_cuda.h) when the mesh's tensor
// degree T is above 1, over the tensor group's NCCL communicator. CUDA builds only.
//
//   tensor only: every rank holds all N tokens of the residual stream; the row-parallel
//     projections' partial outputs (and the column-parallel projections' partial input
//     gradients) are all-reduced in place.
//   sequence on: the residual stream holds N / T rows per rank; enter() all-gathers a block's
//     input (bf16), exit() reduce-scatters the partial output into this rank's rows, and in
//     backward the output gradient is all-gathered and the input gradient reduce-scattered.
//
// Every all-reduce is a reduce-scatter followed by an all-gather (padded to T equal parts), as on
// CPU: each element is summed once, by one rank, in one order, and every rank receives the same
// bits, which the replicated routers' top-k and the replicated parameters' updates rely on.
// Collectives run on the caller's stream, in the order the blocks call them (the same on every
// rank). A count that is not a multiple of T reduces its last (count mod T) elements with one
// NCCL all-reduce. Buffers: six [N, D] device buffers under sequence parallelism (bf16: two for
// gathered inputs, the gathered output gradient, the partial output or input gradient; fp32: the
// gathered output gradient, the partial output or input gradient), none otherwise.
//
// Backward re-gathers each block's saved input for its weight gradients. A prefetch starts that
// gather for the block whose backward comes next, on a communication stream, while the current
// block computes; the next enter() of the same rows waits for it instead of gathering (the two
// input buffers alternate). Without one, enter() gathers on the caller's stream. The model asks
// for the next block's prefetch before the current block's backward (prefetch_next), and it
// starts right after that block's output-gradient gather (exit_backward): the group's
// collectives keep one order on every rank, and the block's own early collectives do not queue
// behind the prefetch.
#pragma once

#include <cstdint>
#include <memory>

#include "blocks/cuda/runners.h"
#include "device/device_buffer.h"
#include "device/side_stream.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {

class CudaTensorParallelLinear final : public blocks::cuda::LinearRunner {
 public:
  using bf16 = blocks::cuda::bf16;
  // tokens: N, the rows a block reads; hidden: D. Throws keel::UsageError when sequence
  // parallelism cannot split N over the group. Allocates its buffers (this rank's GPU).
  CudaTensorParallelLinear(std::shared_ptr<NcclGroup> group, std::int64_t tokens, std::int64_t hidden, bool sequence);
  ~CudaTensorParallelLinear() override;
  CudaTensorParallelLinear(const CudaTensorParallelLinear&) = delete;
  CudaTensorParallelLinear& operator=(const CudaTensorParallelLinear&) = delete;

  std::int64_t rows(std::int64_t tokens) const override { return sequence_ ? tokens / size() : tokens; }
  const bf16* enter(const bf16* x, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;
  // Sequence parallelism (otherwise nothing): gathers x (this rank's rows of a block input) on
  // the communication stream, after the work queued on `stream` so far, for the next enter(x).
  // prefetch() starts now; prefetch_next() at the next exit_backward(). One prefetch is kept: a
  // later one replaces it. forget_prefetch(): drop both (the rows at those addresses change
  // before they are entered again: at the start of a forward, at the end of a backward).
  void prefetch(const bf16* x, std::int64_t tokens, std::int64_t width, cudaStream_t stream);
  void prefetch_next(const bf16* x, std::int64_t tokens, std::int64_t width);
  void forget_prefetch() { pending_ = requested_ = nullptr; }
  bool output_is_whole() const override { return false; }
  bf16* out(bf16* y, std::int64_t tokens, std::int64_t width) override;
  float* out(float* y, std::int64_t tokens, std::int64_t width) override;
  void exit(bf16* partial, bf16* y, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;
  void exit(float* partial, float* y, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;
  const bf16* exit_backward(const bf16* dy, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;
  const float* exit_backward(const float* dy, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;
  float* dx_out(float* dx, std::int64_t tokens, std::int64_t width) override { return out(dx, tokens, width); }
  bf16* dx_out(bf16* dx, std::int64_t tokens, std::int64_t width) override { return out(dx, tokens, width); }
  void enter_backward(float* partial, float* dx, std::int64_t tokens, std::int64_t width,
                      cudaStream_t stream) override {
    exit(partial, dx, tokens, width, stream);
  }
  void enter_backward(bf16* partial, bf16* dx, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override {
    exit(partial, dx, tokens, width, stream);
  }

  int size() const { return group_->size(); }
  int rank() const { return group_->rank(); }
  bool sequence() const { return sequence_; }
  NcclGroup& group() const { return *group_; }
  // In place over the group, the same bits on every rank (reduce-scatter + all-gather).
  void all_reduce(float* data, std::int64_t n, cudaStream_t stream);
  void all_reduce(bf16* data, std::int64_t n, cudaStream_t stream);
  // Device bytes of the runner's own buffers.
  std::size_t device_bytes() const { return bytes_; }

 private:
  void check(std::int64_t tokens, std::int64_t width) const;
  void all_reduce_impl(void* data, std::int64_t n, NcclType type, std::size_t elem, cudaStream_t stream);

  std::shared_ptr<NcclGroup> group_;
  std::int64_t tokens_, hidden_;
  bool sequence_;
  std::size_t bytes_ = 0;
  void* mem_ = nullptr;                            // one allocation, carved below
  bf16* in_bf_[2] = {nullptr, nullptr};            // gathered inputs: [cur_] enter's, the other a prefetch's
  bf16 *dy_bf_ = nullptr, *io_bf_ = nullptr;       // [N, D] each (sequence)
  float *dy_f_ = nullptr, *io_f_ = nullptr;        // [N, D] each (sequence)
  int cur_ = 0;
  const bf16* pending_ = nullptr;                  // the rows the prefetch into in_bf_[1 - cur_] gathers
  const bf16* requested_ = nullptr;                // prefetch_next's rows, not started yet
  void start_requested(cudaStream_t stream);
  SideStream comm_;  // the prefetch's gathers
};

}  // namespace keel::parallel

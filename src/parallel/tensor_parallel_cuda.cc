#include "parallel/tensor_parallel_cuda.h"

#include <fmt/format.h>

#include "common/error.h"
#include "device/cuda_check.h"

namespace keel::parallel {

namespace {
constexpr std::size_t kAlign = 256;
std::size_t aligned(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }
}  // namespace

CudaTensorParallelLinear::CudaTensorParallelLinear(std::shared_ptr<NcclGroup> group, std::int64_t tokens,
                                                   std::int64_t hidden, bool sequence)
    : group_(std::move(group)), tokens_(tokens), hidden_(hidden), sequence_(sequence) {
  if (!group_) fail("tensor parallel (cuda): no tensor group");
  if (sequence_ && tokens_ % group_->size() != 0)
    throw UsageError(fmt::format("sequence parallelism: the micro-batch's {} tokens do not split over {} tensor ranks",
                                 tokens_, group_->size()));
  if (!sequence_) return;
  const std::size_t nd = static_cast<std::size_t>(tokens_ * hidden_);
  const std::size_t b16 = aligned(nd * sizeof(bf16)), f32 = aligned(nd * sizeof(float));
  bytes_ = 4 * b16 + 2 * f32;
  if (cudaMalloc(&mem_, bytes_) != cudaSuccess)
    throw_out_of_gpu_memory("out of GPU memory: sequence parallelism's gather buffers", bytes_,
                            "lower batch.micro_batch or data.seq_length");
  auto* at = static_cast<std::byte*>(mem_);
  in_bf_[0] = reinterpret_cast<bf16*>(at), at += b16;
  in_bf_[1] = reinterpret_cast<bf16*>(at), at += b16;
  dy_bf_ = reinterpret_cast<bf16*>(at), at += b16;
  io_bf_ = reinterpret_cast<bf16*>(at), at += b16;
  dy_f_ = reinterpret_cast<float*>(at), at += f32;
  io_f_ = reinterpret_cast<float*>(at);
}

CudaTensorParallelLinear::~CudaTensorParallelLinear() {
  comm_.synchronize();  // a prefetch may still write into mem_
  if (mem_) cudaFree(mem_);
}

void CudaTensorParallelLinear::check(std::int64_t tokens, std::int64_t width) const {
  if (tokens != tokens_ || width != hidden_)
    fail("tensor parallel (cuda): a block of [{}, {}] through a runner of [{}, {}]", tokens, width, tokens_, hidden_);
}

void CudaTensorParallelLinear::all_reduce_impl(void* data, std::int64_t n, NcclType type, std::size_t elem,
                                               cudaStream_t stream) {
  const int T = size(), r = rank();
  const std::int64_t chunk = n / T, tail = n - chunk * T;
  auto* base = static_cast<std::byte*>(data);
  if (chunk > 0) {
    std::byte* mine = base + static_cast<std::size_t>(r * chunk) * elem;
    group_->reduce_scatter_sum(base, mine, chunk, type, stream);
    group_->all_gather(mine, base, chunk, type, stream);
  }
  if (tail > 0) group_->all_reduce_sum(base + static_cast<std::size_t>(chunk * T) * elem, tail, type, stream);
}

void CudaTensorParallelLinear::all_reduce(float* data, std::int64_t n, cudaStream_t stream) {
  all_reduce_impl(data, n, NcclType::kFloat32, sizeof(float), stream);
}

void CudaTensorParallelLinear::all_reduce(bf16* data, std::int64_t n, cudaStream_t stream) {
  all_reduce_impl(data, n, NcclType::kBfloat16, sizeof(bf16), stream);
}

const CudaTensorParallelLinear::bf16* CudaTensorParallelLinear::enter(const bf16* x, std::int64_t tokens,
                                                                      std::int64_t width, cudaStream_t stream) {
  if (!sequence_) return x;
  check(tokens, width);
  if (pending_ && pending_ == x) {  // prefetched: wait for it, and its buffer is enter's now
    comm_.wait(stream);
    pending_ = nullptr;
    cur_ = 1 - cur_;
    return in_bf_[cur_];
  }
  group_->all_gather(x, in_bf_[cur_], tokens * width / size(), NcclType::kBfloat16, stream);
  return in_bf_[cur_];
}

void CudaTensorParallelLinear::prefetch(const bf16* x, std::int64_t tokens, std::int64_t width, cudaStream_t stream) {
  if (!sequence_) return;
  check(tokens, width);
  // After everything queued so far: x's rows are written, and in_bf_[1 - cur_]'s last reader
  // (the block before the current one) is done with it.
  group_->all_gather(x, in_bf_[1 - cur_], tokens * width / size(), NcclType::kBfloat16, comm_.start(stream));
  comm_.end();
  pending_ = x;
}

void CudaTensorParallelLinear::prefetch_next(const bf16* x, std::int64_t tokens, std::int64_t width) {
  if (!sequence_) return;
  check(tokens, width);
  requested_ = x;
}

void CudaTensorParallelLinear::start_requested(cudaStream_t stream) {
  if (!requested_) return;
  const bf16* x = requested_;
  requested_ = nullptr;
  prefetch(x, tokens_, hidden_, stream);
}

CudaTensorParallelLinear::bf16* CudaTensorParallelLinear::out(bf16* y, std::int64_t tokens, std::int64_t width) {
  if (!sequence_) return y;
  check(tokens, width);
  return io_bf_;
}

float* CudaTensorParallelLinear::out(float* y, std::int64_t tokens, std::int64_t width) {
  if (!sequence_) return y;
  check(tokens, width);
  return io_f_;
}

void CudaTensorParallelLinear::exit(bf16* partial, bf16* y, std::int64_t tokens, std::int64_t width,
                                    cudaStream_t stream) {
  if (sequence_)
    group_->reduce_scatter_sum(partial, y, tokens * width / size(), NcclType::kBfloat16, stream);
  else
    all_reduce(y, tokens * width, stream);
}

void CudaTensorParallelLinear::exit(float* partial, float* y, std::int64_t tokens, std::int64_t width,
                                    cudaStream_t stream) {
  if (sequence_)
    group_->reduce_scatter_sum(partial, y, tokens * width / size(), NcclType::kFloat32, stream);
  else
    all_reduce(y, tokens * width, stream);
}

const CudaTensorParallelLinear::bf16* CudaTensorParallelLinear::exit_backward(const bf16* dy, std::int64_t tokens,
                                                                              std::int64_t width, cudaStream_t stream) {
  if (!sequence_) return dy;
  check(tokens, width);
  group_->all_gather(dy, dy_bf_, tokens * width / size(), NcclType::kBfloat16, stream);
  start_requested(stream);
  return dy_bf_;
}

const float* CudaTensorParallelLinear::exit_backward(const float* dy, std::int64_t tokens, std::int64_t width,
                                                     cudaStream_t stream) {
  if (!sequence_) return dy;
  check(tokens, width);
  group_->all_gather(dy, dy_f_, tokens * width / size(), NcclType::kFloat32, stream);
  start_requested(stream);
  return dy_f_;
}

}  // namespace keel::parallel

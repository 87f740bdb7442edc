#include "parallel/tensor_parallel.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "common/mpi_session.h"

namespace keel::parallel {

TensorGroup::TensorGroup(MPI_Comm comm) : comm_(comm) {
  if (comm_ == MPI_COMM_NULL) return;
  mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
}

void TensorGroup::all_gather(const float* part, float* whole, std::int64_t part_floats) const {
  if (size_ == 1) {
    if (whole != part) std::memcpy(whole, part, sizeof(float) * static_cast<std::size_t>(part_floats));
    return;
  }
  if (part_floats > INT32_MAX) fail("tensor parallel: an all-gather of {} floats per rank is too large", part_floats);
  mpi_check(MPI_Allgather(part, static_cast<int>(part_floats), MPI_FLOAT, whole, static_cast<int>(part_floats),
                          MPI_FLOAT, comm_),
            "MPI_Allgather");
}

void TensorGroup::reduce_scatter(const float* whole, float* part, std::int64_t part_floats) const {
  if (size_ == 1) {
    if (whole != part) std::memcpy(part, whole, sizeof(float) * static_cast<std::size_t>(part_floats));
    return;
  }
  if (part_floats > INT32_MAX) fail("tensor parallel: a reduce-scatter of {} floats per rank is too large", part_floats);
  mpi_check(MPI_Reduce_scatter_block(whole, part, static_cast<int>(part_floats), MPI_FLOAT, MPI_SUM, comm_),
            "MPI_Reduce_scatter_block");
}

void TensorGroup::all_reduce(float* data, std::int64_t n) const {
  if (size_ == 1 || n == 0) return;
  const std::int64_t chunk = (n + size_ - 1) / size_;
  const float* whole = data;
  if (chunk * size_ != n) {  // pad to T equal parts
    pad_.assign(static_cast<std::size_t>(chunk * size_), 0.f);
    std::memcpy(pad_.data(), data, sizeof(float) * static_cast<std::size_t>(n));
    whole = pad_.data();
  }
  part_.resize(static_cast<std::size_t>(chunk));
  reduce_scatter(whole, part_.data(), chunk);
  if (chunk * size_ == n) {
    all_gather(part_.data(), data, chunk);
  } else {
    all_gather(part_.data(), pad_.data(), chunk);
    std::memcpy(data, pad_.data(), sizeof(float) * static_cast<std::size_t>(n));
  }
}

double TensorGroup::sum(double v) const {
  if (size_ == 1) return v;
  std::vector<double> all(static_cast<std::size_t>(size_));
  mpi_check(MPI_Allgather(&v, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, comm_), "MPI_Allgather");
  double s = 0;
  for (double x : all) s += x;
  return s;
}

TensorParallelLinear::TensorParallelLinear(MPI_Comm tensor, std::int64_t tokens, std::int64_t hidden, bool sequence)
    : group_(tensor), tokens_(tokens), hidden_(hidden), sequence_(sequence) {
  if (sequence_ && tokens_ % group_.size() != 0)
    throw UsageError(fmt::format("sequence parallelism: the micro-batch's {} tokens do not split over {} tensor ranks",
                                 tokens_, group_.size()));
  if (sequence_)
    for (auto* b : {&in_, &out_, &dx_}) b->resize(static_cast<std::size_t>(tokens_ * hidden_));
}

Tensor TensorParallelLinear::gathered(const Tensor& local, std::vector<float>& buf) {
  group_.all_gather(local.data(), buf.data(), local.numel());
  return Tensor(buf.data(), {tokens_, hidden_});
}

Tensor TensorParallelLinear::enter(const Tensor& x) { return sequence_ ? gathered(x, in_) : x; }

Tensor TensorParallelLinear::out(const Tensor& y) { return sequence_ ? Tensor(out_.data(), {tokens_, hidden_}) : y; }

void TensorParallelLinear::exit(const Tensor& partial, const Tensor& y) {
  if (sequence_)
    group_.reduce_scatter(partial.data(), y.data(), y.numel());
  else
    group_.all_reduce(y.data(), y.numel());
}

Tensor TensorParallelLinear::exit_backward(const Tensor& dy) { return sequence_ ? gathered(dy, out_) : dy; }

Tensor TensorParallelLinear::dx_out(const Tensor& dx) { return sequence_ ? Tensor(dx_.data(), {tokens_, hidden_}) : dx; }

void TensorParallelLinear::enter_backward(const Tensor& partial, const Tensor& dx) { exit(partial, dx); }

bool tp_partial_gradient(const optim::ParamInfo& p, bool sequence) {
  if (p.placement.splits(mesh::Axis::kTensor)) return false;
  // The token regions between the blocks: whole on every rank unless the tokens are split.
  const bool token_region = p.name.ends_with(".attn_norm.weight") || p.name.ends_with(".mlp_norm.weight") ||
                            p.name == "final_norm.weight" || p.name.find("res_scale.") != std::string::npos;
  return sequence || !token_region;
}

void reduce_partial_gradients(const TensorGroup& group, const optim::ParamLayout& layout, bool sequence, float* grads) {
  if (group.size() == 1) return;
  std::vector<const optim::ParamInfo*> partial;
  std::int64_t n = 0;
  for (const auto& p : layout.params)
    if (tp_partial_gradient(p, sequence)) partial.push_back(&p), n += p.numel;
  std::vector<float> pack(static_cast<std::size_t>(n));
  std::int64_t at = 0;
  for (const auto* p : partial) {
    std::memcpy(pack.data() + at, grads + p->offset, sizeof(float) * static_cast<std::size_t>(p->numel));
    at += p->numel;
  }
  group.all_reduce(pack.data(), n);
  at = 0;
  for (const auto* p : partial) {
    std::memcpy(grads + p->offset, pack.data() + at, sizeof(float) * static_cast<std::size_t>(p->numel));
    at += p->numel;
  }
}

}  // namespace keel::parallel

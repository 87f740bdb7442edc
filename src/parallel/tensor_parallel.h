// Megatron tensor parallelism on CPU ranks (MPI), with sequence parallelism as an option: the
// runners the plan (plan.h) hands every block when the mesh's tensor degree T is above 1, and the
// reductions the optimizer step needs. The placements (which weights are split, and how) are in
// model/param_layout.cc; the local sizes in blocks/shape.h.
//
// A sub-block (attention, MLP, experts) reads its input whole, runs column-parallel projections
// (its heads, its FFN columns) and a row-parallel output projection whose output is a partial
// sum over the group (Megatron's f and g):
//   tensor only (sequence off): every rank holds all N tokens of the residual stream. enter: x;
//     exit: all-reduce of the partial output. Backward: dy as is; the input gradient all-reduced.
//   sequence on: the residual stream, norms and residual scales hold N / T rows (rank r: rows
//     [r N/T, (r+1) N/T)). enter: all-gather of the rows; exit: reduce-scatter of the partial
//     output into this rank's rows. Backward: all-gather of dy; reduce-scatter of the input
//     gradient. Activation memory outside the blocks divides by T.
// Every all-reduce here is a reduce-scatter followed by an all-gather, so each element is summed
// once, in one order, and every rank holds bit-identical results: the replicated computations
// after it (norms, the routers' top-k) must agree exactly on every rank.
//
// Gradients: a parameter split over the tensor axis gets its whole gradient on its rank. A
// replicated one gets a partial gradient where its rank saw part of the work
// (tp_partial_gradient): the routers (their gate gradients come from partial expert outputs), kv
// projections replicated over more ranks than kv heads, and under sequence parallelism the
// norms and residual scales (their rank's tokens). reduce_partial_gradients sums those over the
// group once per step, before the norm and the update.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "blocks/runners.h"
#include "optim/param_groups.h"
#include "tensor/tensor.h"

namespace keel::parallel {

// Collectives over one tensor group of T ranks on fp32 host rows.
class TensorGroup {
 public:
  explicit TensorGroup(MPI_Comm comm);  // MPI_COMM_NULL: one rank
  int size() const { return size_; }
  int rank() const { return rank_; }
  // Every rank's `part` (the same element count on each) into `whole`, rank order.
  void all_gather(const float* part, float* whole, std::int64_t part_floats) const;
  // whole (summed over the ranks) -> this rank's 1/T part of it, rank order.
  void reduce_scatter(const float* whole, float* part, std::int64_t part_floats) const;
  // In place, the same bits on every rank (reduce-scatter + all-gather, padded to T parts).
  void all_reduce(float* data, std::int64_t n) const;
  // The sum of every rank's v, added in rank order: the same bits on every rank.
  double sum(double v) const;
  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int size_ = 1, rank_ = 0;
  mutable std::vector<float> pad_, part_;
};

// The tensor-parallel boundary of every block (blocks/runners.h): stateless between calls apart
// from three [N, D] buffers it reuses, so one runner serves every layer.
class TensorParallelLinear final : public blocks::LinearRunner {
 public:
  // tokens: N, the rows a block reads (the micro-batch's tokens); hidden: D.
  TensorParallelLinear(MPI_Comm tensor, std::int64_t tokens, std::int64_t hidden, bool sequence);
  Tensor enter(const Tensor& x) override;
  Tensor out(const Tensor& y) override;
  void exit(const Tensor& partial, const Tensor& y) override;
  Tensor exit_backward(const Tensor& dy) override;
  Tensor dx_out(const Tensor& dx) override;
  void enter_backward(const Tensor& partial, const Tensor& dx) override;

  const TensorGroup& group() const { return group_; }
  bool sequence() const { return sequence_; }

 private:
  Tensor gathered(const Tensor& local, std::vector<float>& buf);
  TensorGroup group_;
  std::int64_t tokens_, hidden_;
  bool sequence_;
  std::vector<float> in_, out_, dx_;  // [N, D] each, under sequence parallelism
};

// Whether parameter p's gradient on one tensor rank is a partial sum (see the top).
bool tp_partial_gradient(const optim::ParamInfo& p, bool sequence);
// Sums the partial gradients (tp_partial_gradient) of `layout` over the group, in place.
void reduce_partial_gradients(const TensorGroup& group, const optim::ParamLayout& layout, bool sequence, float* grads);

}  // namespace keel::parallel

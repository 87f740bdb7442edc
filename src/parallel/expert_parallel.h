// Expert parallelism for the dropless MoE (ops/moe.h) on CPU ranks: the E experts are sharded
// over an expert-parallel group of P ranks (rank r holds experts [r E/P, (r + 1) E/P)), every
// rank routes its own tokens, and tokens travel to the ranks holding their experts and back.
//
// Forward, per MoE layer:
//   1. this rank's N * top_k routed slots sorted by expert (moe::make_plan, by the caller); the
//      slots of the experts of rank r are then one contiguous block;
//   2. exchange the per-expert counts (MPI_Alltoall, E/P numbers per rank pair), so every rank
//      knows how many rows it receives for each of its experts from each source;
//   3. send the slots' token rows (MPI_Alltoallv); reorder the received rows from source-major
//      to expert-major, so each local expert's rows are contiguous;
//   4. run the local experts' SwiGLU MLPs on their blocks (moe::forward with one unit gate per
//      row: the grouped GEMMs of the single-rank path);
//   5. send the expert outputs back (MPI_Alltoallv, the counts mirrored) and combine them in
//      token order with the router gates, as moe::forward does.
// Backward mirrors it: gate gradients and gate-weighted output gradients per slot at the
// token's rank, the slot gradients to the experts' ranks, the local experts' backward (weight
// gradients of the local experts only, accumulated), the input gradients back, summed per
// token. Dropless: a rank may receive any number of rows (0 included); nothing is dropped.
//
// Results equal the single-rank moe::forward/backward over the same tokens: the same GEMMs per
// expert on the same rows (row order within an expert differs, which changes only the
// summation order of the weight gradients: fp32 rounding). Expert weight gradients are this
// rank's tokens' share; the trainer reduces them over the ranks holding the same experts.
//
// The GPU path: expert_parallel_cuda.h.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "ops/moe.h"
#include "tensor/tensor.h"

namespace keel::parallel {

// Where the rows a rank receives for its experts go when stored expert-major: local expert j's
// rows from source 0, then from source 1, and so on. recv[p * El + j]: rows that source p sends
// for local expert j (the count exchange's result).
struct ExpertMajorLayout {
  std::vector<std::int64_t> block_start;     // [P * El]: first row of the (p, j) block
  std::vector<std::int64_t> expert_offsets;  // [El + 1]: local expert j owns rows [o[j], o[j + 1])
  std::int64_t rows() const { return expert_offsets.back(); }
};
// Throws keel::Error when recv does not hold P * El counts or one is negative.
ExpertMajorLayout expert_major_layout(const std::vector<std::int64_t>& recv, int sources, int local_experts);

class ExpertParallelMoe final : public ops::moe::ExpertRunner {
 public:
  // comm: the expert-parallel group (not owned; it must outlive the object); experts: E of the
  // whole layer, a multiple of the group size (keel::UsageError otherwise).
  ExpertParallelMoe(MPI_Comm comm, int experts);

  int group_size() const { return size_; }
  int local_experts() const { return experts_ / size_; }
  int first_expert() const { return rank_ * local_experts(); }

  // plan: this rank's slots sorted over all E experts (moe::make_plan of its routing, as the
  // single-rank path makes it); x [N, D] this rank's tokens, gates [N, top_k]; local: this
  // rank's experts (W_gate, W_up [E/P, F, D], W_down [E/P, D, F]); y [N, D]. Every rank of the
  // group calls it together, N = 0 included. Keeps what backward needs until the next call.
  void forward(const ops::moe::Plan& plan, const Tensor& x, const Tensor& gates, const ops::moe::Weights& local,
               const Tensor& y);
  // dy [N, D]; dx [N, D] and dgates [N, top_k] are overwritten (either may be empty);
  // local_grads (shapes of `local`, any may be empty) accumulated (+=). Collective.
  void backward(const Tensor& dy, const ops::moe::Weights& local, const Tensor& dx, const Tensor& dgates,
                const ops::moe::Weights& local_grads);

  // The same as an ops::moe::ExpertRunner (the caller's saved rows and scratch are not used: the
  // rows live at the experts' ranks).
  void forward(const ops::moe::Plan& plan, const Tensor& x, const Tensor& gates, const ops::moe::Weights& w,
               const ops::moe::Saved&, const Tensor& y) override {
    forward(plan, x, gates, w, y);
  }
  void backward(const ops::moe::Plan&, const Tensor&, const Tensor&, const ops::moe::Weights& w,
                const ops::moe::Saved&, const Tensor& dy, const Tensor&, const Tensor& dx, const Tensor& dgates,
                const ops::moe::Weights& dweights) override {
    backward(dy, w, dx, dgates, dweights);
  }
  bool collective() const override { return true; }

  // Rows this rank's experts computed in the last forward (tokens of the whole group).
  std::int64_t received_rows() const { return static_cast<std::int64_t>(expert_major_.size()); }

 private:
  // Sends rows of `width` floats: send_rows[p] rows to rank p from `send` (rank-major), into
  // `recv` (recv_rows[p] rows from rank p, rank-major).
  void exchange(const float* send, const std::vector<std::int64_t>& send_rows, float* recv,
                const std::vector<std::int64_t>& recv_rows, std::int64_t width) const;

  MPI_Comm comm_;
  int size_ = 1, rank_ = 0, experts_ = 0;

  // Saved by forward for backward.
  ops::moe::Plan plan_;                     // this rank's slots sorted by global expert
  std::vector<std::int64_t> send_rows_;     // [P] slots sent to each rank
  std::vector<std::int64_t> recv_rows_;     // [P] rows received from each rank
  std::vector<std::int32_t> expert_major_;  // [R] expert-major row -> its source-major row
  ops::moe::Plan local_plan_;               // the received rows over the local experts (top-1)
  std::int64_t d_ = 0, f_ = 0;
  std::vector<float> gates_, x_local_, ys_sorted_, unit_gates_;
  std::vector<float> h_gate_, h_up_, act_, xs_local_, ys_local_;
};

}  // namespace keel::parallel

// Expert parallelism on GPUs: the CUDA twin of expert_parallel.h. The E experts of each MoE
// layer are sharded over an expert-parallel group of P GPUs (rank r holds experts
// [r E/P, (r + 1) E/P)); every rank routes its own tokens and the tokens travel to the GPUs
// holding their experts and back (dropless: a GPU takes whatever arrives, nothing is dropped).
//
// Forward of one layer (CudaExpertParallelMoe::forward, an ops/cuda/moe.h ExpertRunner):
//   1. the caller's plan sorts this rank's S = N top_k slots by global expert (moe::make_plan,
//      whose one host sync brings the per-expert counts to the host); dispatch_rows gathers the
//      slots' token rows in that order, so the rows for rank p's experts are one block, and
//      within it each expert's rows are contiguous;
//   2. the per-(rank, local expert) counts are exchanged on the host (MPI_Alltoall over the
//      group, E numbers per rank), so each rank knows the rows it receives per source and expert;
//   3. one NCCL group of send/recv pairs moves the rows: each (source, local expert) block lands
//      at its place in an expert-major buffer (expert j's rows from every source contiguous), so
//      no permutation pass is needed on either side;
//   4. the local experts' SwiGLU MLPs run on their blocks (moe::experts_forward: the grouped
//      GEMMs of the one-GPU path);
//   5. the outputs return by the mirrored send/recv group into the slot order, and
//      moe::combine sums them per token with the router gates.
// Backward mirrors it: moe::combine_backward at the tokens' rank (gate gradients and the
// gate-weighted output gradients per slot, bf16), those to the experts' ranks, the local experts'
// backward (weight gradients of the local experts, accumulated; the input rows' gradients in
// fp32), those back, summed per token (moe::combine_dx). One host sync per layer in forward (the
// plan's) plus the count exchange; backward never syncs the host.
//
// Results equal moe::forward / moe::backward over the same tokens up to the row order inside
// each expert's GEMMs (fp32 accumulation order of the weight gradients; a GEMM of other height
// may pick another kernel). Expert weight gradients are this rank's tokens' share: the trainer
// reduces them over the ranks holding the same experts.
//
// Memory: the rows a rank receives depend on the routing (up to P S when every token of the
// group picks its experts), so each layer's saved rows (xs, h_gate, h_up, act, ys at the
// experts' rank) and the shared backward scratch live in device buffers that grow on demand
// (25% headroom; growing synchronizes the stream once). The caller's Saved keeps only the slot
// buffers at the tokens' rank: xs [S, D] (send staging) and ys [S, D] (outputs for combine and
// its backward); its h_gate, h_up, act are not used.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "device/device_buffer.h"
#include "ops/cuda/moe.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {

// Expert parallelism's device buffers grow with the rows a GPU receives (25% headroom each
// time); when they cannot, the error says so and what to change.
inline constexpr const char* kEpBufferOomHead = "out of GPU memory: expert parallelism's ";
inline constexpr const char* kEpBufferOomAdvice =
    "the experts of this GPU received more tokens than fit; lower batch.micro_batch or raise parallel.expert";
inline constexpr double kEpBufferHeadroom = 0.25;

// What the MoE layers of one model share: the group's communicators and the backward scratch.
class CudaExpertParallelGroup {
 public:
  // comm: the expert-parallel group and nccl its NCCL communicator (parallel::Mesh: its expert
  // group's, which outlive this object). experts: E of a whole layer, a multiple of the group size
  // (keel::UsageError otherwise).
  CudaExpertParallelGroup(MPI_Comm comm, std::shared_ptr<NcclGroup> nccl, int experts);

  int size() const { return size_; }
  int rank() const { return rank_; }
  int experts() const { return experts_; }
  int local_experts() const { return experts_ / size_; }
  MPI_Comm comm() const { return comm_; }
  NcclGroup& nccl() { return *nccl_; }
  GrowingDeviceBuffer& scratch() { return scratch_; }
  std::size_t device_bytes() const { return scratch_.capacity(); }

 private:
  MPI_Comm comm_;
  int size_ = 1, rank_ = 0, experts_ = 0;
  std::shared_ptr<NcclGroup> nccl_;
  GrowingDeviceBuffer scratch_{kEpBufferOomHead, kEpBufferOomAdvice, kEpBufferHeadroom};
};

// One MoE layer's experts over the group (see the top of this file). forward() and backward()
// are collective over the group: every rank calls them together, with no tokens included, and
// with the same null-ness of dx.
class CudaExpertParallelMoe final : public ops::cuda::moe::ExpertRunner {
 public:
  explicit CudaExpertParallelMoe(std::shared_ptr<CudaExpertParallelGroup> group);

  // plan over all E experts (make_plan of this rank's routing); w: this rank's E / P experts;
  // saved: xs and ys of [S, D] (h_gate, h_up, act unused).
  void forward(const ops::cuda::moe::Plan& plan, const ops::cuda::bf16* x, const float* gates,
               const ops::cuda::moe::Weights& w, std::int64_t d, std::int64_t f, const ops::cuda::moe::Saved& saved,
               float* y, cudaStream_t stream) override;
  // `scratch` is not used (the group's own grows to what the received rows need).
  void backward(const ops::cuda::moe::Plan& plan, const float* gates, const ops::cuda::moe::Weights& w,
                std::int64_t d, std::int64_t f, const ops::cuda::moe::Saved& saved, const float* dy, void* scratch,
                ops::cuda::bf16* dx, float* dgates, const ops::cuda::moe::Grads& dweights,
                cudaStream_t stream) override;
  bool collective() const override { return true; }

  // Rows this rank's experts computed in the last forward (tokens of the whole group).
  std::int64_t received_rows() const { return local_offsets_.empty() ? 0 : local_offsets_.back(); }
  std::size_t device_bytes() const { return rows_.capacity(); }

 private:
  // Moves rows of `width` elements of `bytes` each between the slot order at the tokens' rank
  // (`slots`, blocks by plan offsets) and the expert-major order at the experts' rank (`local`);
  // to_experts picks the direction.
  void exchange(const ops::cuda::moe::Plan& plan, void* slots, void* local, std::int64_t width, NcclType type,
                bool to_experts, cudaStream_t stream);

  std::shared_ptr<CudaExpertParallelGroup> group_;
  // From the last forward: rows received from source p for local expert j
  // (recv_[p * El + j]), where that block starts in the expert-major buffer, the local experts'
  // row offsets (El + 1), and the plan's slot count.
  std::vector<std::int64_t> recv_, recv_at_, local_offsets_;
  std::int64_t d_ = 0, f_ = 0;
  // xs, h_gate, h_up, act, ys of the received rows
  GrowingDeviceBuffer rows_{kEpBufferOomHead, kEpBufferOomAdvice, kEpBufferHeadroom};
  ops::cuda::moe::Saved local_;     // carved from rows_
};

}  // namespace keel::parallel

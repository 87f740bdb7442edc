// Muon over tensor-parallel shards on GPUs: the GPU twin of tensor_parallel_muon.h's
// gather-to-owner step (read that first), over the tensor group's NCCL communicator. CUDA
// builds only.
//
// For the Muon parameters split over the tensor axis (tp_muon_split), in batches of consecutive
// parameters (at most kBatchFloats of this rank's floats each):
//   1. every rank updates its block of the momentum and forms its block of U
//      (ops::cuda::muon::block_momentum: the same floats as the one-GPU step's);
//   2. each matrix has an owner (tp_muon_balance_owners: Newton-Schulz work balanced over the
//      group); one NCCL group of sends and receives brings every rank's block of U to it;
//   3. the owner reassembles its whole matrices (row blocks, CCA's row parts, or column blocks)
//      and orthogonalizes them (ops::cuda::muon::matrix_step with momentum 0 and no Nesterov on
//      scratch: X from the whole U, k from the whole matrix's shape, update_out = k X);
//   4. the blocks of k X go back in a second NCCL group, and every rank applies them to its block
//      (ops::cuda::muon::block_update), refreshing the bf16 copy.
// Two exchanges of fp32 blocks per batch; the owners' Newton-Schulz runs at once. Parameters not
// split over the tensor axis (replicated, whole on every rank) are not touched: every rank steps
// them alike with matrix_step. Results equal the one-GPU step up to the Newton-Schulz GEMMs'
// bf16 rounding (the same operations on the same whole matrices). Memory: per batch, this rank's
// U and k X blocks and, for the matrices it owns, T blocks of staging and four whole matrices
// (U, scratch momentum and parameter, k X) plus matrix_step's workspace; all grow on demand.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "device/device_buffer.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/muon.h"
#include "optim/muon.h"
#include "optim/param_groups.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {

class CudaTensorParallelMuon {
 public:
  using bf16 = ops::cuda::bf16;
  static constexpr std::int64_t kBatchFloats = std::int64_t(64) << 20;  // this rank's floats per batch

  // A flat range [begin, end) whose matrices are stepped, its momentum at momentum[at] on.
  struct Range {
    std::int64_t begin = 0, end = 0, at = 0;
  };
  // layout: this rank's; group: the tensor group. ranges: the flat ranges whose matrices are
  // stepped (ZeRO-1: the rank's shard over the data axis and, with expert parallelism, its
  // expert shard; ZeRO-1's cuts never split a Muon matrix; the same ranges on every rank of the
  // group, as their layouts are alike); empty: the whole layout, momentum at the same offsets.
  CudaTensorParallelMuon(const optim::MuonConfig& c, const optim::ParamLayout& layout, std::shared_ptr<NcclGroup> group,
                         std::vector<Range> ranges = {});
  ~CudaTensorParallelMuon();
  // Whether parameter `index` of the layout is stepped here (split over the tensor axis, Muon;
  // the optimizer leaves all its matrices to this, including those outside the range).
  bool owns(std::size_t index) const { return split_[index]; }
  // One step of every tensor-split Muon matrix in the ranges: params, grads, params_bf16 are
  // this rank's flat buffers at the layout's offsets, momentum the ranges' (Range::at). lr: the
  // scheduled
  // rate (times each parameter's lr_scale here); device_grad_scale: the clip coefficient.
  // Collective over the group, on `stream`.
  void step(float* params, const float* grads, float* momentum, bf16* params_bf16, double lr,
            const float* device_grad_scale, ops::cuda::GemmRunner& gemm, cudaStream_t stream);

 private:
  struct Tensor;  // one split parameter's geometry
  void step_batch(const std::vector<const Tensor*>& batch, float* params, const float* grads, float* momentum,
                  bf16* params_bf16, double lr, const float* device_grad_scale, ops::cuda::GemmRunner& gemm,
                  cudaStream_t stream);

  optim::MuonConfig c_, owner_c_;  // owner_c_: momentum 0, no Nesterov (M = U)
  const optim::ParamLayout& layout_;
  std::shared_ptr<NcclGroup> group_;
  std::vector<bool> split_;
  std::vector<std::vector<const Tensor*>> batches_;
  std::vector<std::unique_ptr<Tensor>> tensors_;
  GrowingDeviceBuffer local_, owned_, workspace_;
};

}  // namespace keel::parallel

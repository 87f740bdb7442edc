// The optimizer step of GPU training over flat device buffers: the global-norm clip (on the
// device; one host sync to read the norm) and AdamW on the AdamW parameters and Muon on the
// whole matrices of any range of the flat buffer this rank owns, with the moments of its
// optimizer slice (train/backend.h: the replicated shard's, then the expert shard's). One GPU
// steps everything; ZeRO-1 steps the rank's shard (the classic step) or bucket by bucket
// (parallel/zero1_overlap_cuda.h, through the ShardOptimizer interface). CUDA builds only.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "device/device_arena.h"
#include "ops/cuda/adamw.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/muon.h"
#include "parallel/zero1_overlap_cuda.h"
#include "train/backend.h"

namespace keel::train {

class CudaOptimizer final : public parallel::ShardOptimizer {
 public:
  using bf16 = ops::cuda::bf16;
  struct Buffers {
    float* params = nullptr;  // fp32 masters
    bf16* params_bf16 = nullptr;
    float* grads = nullptr;
    float* m = nullptr;  // the slice's moments (moment_ranges)
    float* v = nullptr;
    void* muon_workspace = nullptr;  // ops::cuda::muon::workspace_bytes(layout); null without Muon
  };

  CudaOptimizer(const OptimizerConfig& config, const optim::ParamLayout& layout, const StateSlice& slice);
  // The norm's device scalars and workspace (from the activation arena).
  void carve(DeviceCarver& c);
  void bind(const Buffers& b) { buf_ = b; }

  // The learning rate of the step that follows (times each group's lr_scale).
  void set_lr(double lr) { lr_ = lr; }
  // One GPU: the norm over every gradient, then AdamW and Muon over the whole buffer. Throws
  // optim::NonFiniteGradient (nothing updated) when the norm is not finite.
  std::pair<double, float> step_all(double max_norm, ops::cuda::GemmRunner& gemm, cudaStream_t stream);
  // Throws optim::NonFiniteGradient when `norm` (read_norm's) is not finite.
  static void require_finite(double norm);

  std::int64_t step_count() const { return adam_.step_count(); }
  // The parameters whose Muon step runs elsewhere (tensor parallelism:
  // parallel::CudaTensorParallelMuon), by layout index: update() leaves their matrices alone.
  void set_muon_elsewhere(std::vector<bool> elsewhere) { muon_elsewhere_ = std::move(elsewhere); }
  // The device clip coefficient of the last clip() (the gradients' scale for the updates).
  const float* clip_coefficient() const { return coef_; }
  double lr() const { return lr_; }
  void set_step_count(std::int64_t t) { adam_.set_step_count(t); }

  // The sum of squares in two parts (sum_squares_buffer()[0] and [1]), to be reduced over
  // different groups (tensor parallelism with data parallelism: the blocks split over the tensor
  // axis are summed over both, the replicated parameters over the data axis only), then
  // clip_parts() adds them.
  void sum_squares_part(int part, std::int64_t begin, std::int64_t end, bool accumulate, cudaStream_t stream);
  void clip_parts(double max_norm, cudaStream_t stream);

  // parallel::ShardOptimizer
  void sum_squares(std::int64_t begin, std::int64_t end, bool accumulate, cudaStream_t stream) override;
  double* sum_squares_buffer() override { return sum_sq_; }
  void clip(double max_norm, cudaStream_t stream) override;
  std::pair<double, float> read_norm(cudaStream_t stream) override;
  void begin_updates() override { t0_ = adam_.step_count(); }
  void update(std::int64_t begin, std::int64_t end, ops::cuda::GemmRunner& gemm, cudaStream_t stream) override;
  void end_updates() override { adam_.set_step_count(t0_ + 1); }

 private:
  // Where the moments of flat offset o sit in m / v: the replicated shard's first, then (expert
  // parallelism) the expert shard's.
  std::int64_t moment_index(std::int64_t o) const;

  const optim::ParamLayout& layout_;
  StateSlice slice_;
  ops::cuda::adamw::DeviceAdamW adam_;
  ops::cuda::muon::DeviceMuon muon_;
  Buffers buf_;
  double lr_ = 0;
  std::int64_t t0_ = 0;  // the AdamW step of the updates in progress (every call runs at t0 + 1)
  double *norm_ws_ = nullptr, *sum_sq_ = nullptr, *norm_ = nullptr;
  float* coef_ = nullptr;
  std::vector<bool> muon_elsewhere_;
};

}  // namespace keel::train

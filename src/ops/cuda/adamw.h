// Fused AdamW on the GPU: the CUDA twin of optim/adamw.h, the same update with the same
// roundings (the step scalars are computed on the host in double exactly as the CPU optimizer
// does, then rounded once to fp32; the per-element math is fp32 with every multiply and add
// rounded separately, no fused multiply-adds, IEEE sqrt and division), so a GPU step matches
// the CPU step bit for bit on the same inputs. At 1-based step t, for every element:
//   g  = s * grad
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g^2
//   p  = p * (1 - lr * wd) - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// (decoupled weight decay: wd multiplies the old p and is never seen by m or v).
//
// Buffers: param, grad, m, v fp32 (device), n elements each, already offset to the range to
// update; param, m and v are updated in place, grad is only read. param_bf16 (optional, may be
// null) receives bf16(p) of the updated parameters, so the training step needs no separate
// cast before the next forward's GEMMs.
//
// Gradient scale s = grad_scale (host) * *device_grad_scale (when not null; e.g. the clip
// coefficient from grad_norm.h, which stays on the device so clipping needs no host sync).
// A non-finite device scale (grad_norm.h writes NaN for a non-finite gradient norm) makes the
// update a no-op: param, m, v and param_bf16 are left exactly as they were. The host cannot
// see that without a sync, so the trainer must read the norm before trusting the step and,
// on a non-finite one, treat the step as skipped (DeviceAdamW::set_step_count(t - 1)).
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"
#include "optim/adamw.h"
#include "optim/param_groups.h"

namespace keel::ops::cuda::adamw {

// The hyperparameters of one parameter group for one call. weight_decay is the effective decay
// (0 for groups that do not decay); lr is the scheduled lr times the group's lr_scale.
struct Hyper {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0;
};

// One fused update of n elements at 1-based step t. Throws keel::Error (before launching) on
// t < 1, n < 0, a non-finite or negative lr, a non-finite grad_scale or hyperparameters that
// optim::validate() rejects.
void update(float* param, const float* grad, float* m, float* v, bf16* param_bf16, std::int64_t n, const Hyper& h,
            std::int64_t t, float grad_scale, const float* device_grad_scale, cudaStream_t stream);

// The device counterpart of optim::FlatRange: [begin, end) of the flat buffers; param, grad
// and param_bf16 (optional) address element `begin` of their buffers, m and v hold end - begin
// floats (ZeRO-1 shard-local states).
struct DeviceFlatRange {
  std::int64_t begin = 0, end = 0;
  float* param = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  bf16* param_bf16 = nullptr;
};

// optim::AdamW on device buffers: the same step counter, the same per-parameter selection
// (AdamW parameters of the layout that intersect the range; Muon parameters and padding are not
// touched, nor is their bf16 copy) and the same per-parameter decay / lr_scale. One launch per
// intersected parameter, all on `stream`; nothing synchronizes the host.
class DeviceAdamW {
 public:
  explicit DeviceAdamW(const optim::AdamWConfig& c);

  // Increments the step counter first, so the first call uses t = 1. Throws like
  // optim::AdamW::step on a bad range, lr or grad_scale.
  void step(const optim::ParamLayout& layout, const DeviceFlatRange& range, double lr, float grad_scale,
            const float* device_grad_scale, cudaStream_t stream);

  std::int64_t step_count() const { return t_; }
  void set_step_count(std::int64_t t);  // checkpoint restore, or undoing a skipped step
  const optim::AdamWConfig& config() const { return c_; }

 private:
  optim::AdamWConfig c_;
  std::int64_t t_ = 0;
};

}  // namespace keel::ops::cuda::adamw

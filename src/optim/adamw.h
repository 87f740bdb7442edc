// AdamW (Loshchilov & Hutter, arXiv 1711.05101) with decoupled weight decay and bias
// correction, fp32 states, one fused loop per parameter. Same update as torch.optim.AdamW.
//
// At step t (1-based), with lr = scheduled lr * the parameter's lr_scale, gradient scale s
// (clipping coefficient x 1/accumulation, see clip.h), for every element:
//   g  = s * grad
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g^2
//   p  = p * (1 - lr * wd) - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// where wd = weight_decay for parameters whose group decays, else 0. Decay multiplies the old
// p (decoupled: it is not part of g and not seen by m or v). m and v start at zero.
//
// Sharding: the update is elementwise, so it runs on any contiguous range [begin, end) of the
// flat parameter buffer (param_groups.h). Under ZeRO-1 each data-parallel rank owns one range
// and holds m and v for that range only; the per-parameter hyperparameters (decay on/off,
// lr_scale) come from the layout for every parameter the range intersects.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/param_groups.h"

namespace keel::optim {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// Throws keel::Error (one line) unless 0 <= beta < 1, eps > 0 and weight_decay >= 0 (all finite).
void validate(const AdamWConfig& c);

// The fused loop for n elements at 1-based step t. decay selects wd = c.weight_decay or 0.
void adamw_update(float* param, const float* grad, float* m, float* v, std::int64_t n, const AdamWConfig& c,
                  std::int64_t t, double lr, bool decay, float grad_scale = 1.0f);

// A contiguous range [begin, end) of the flat buffers. Each pointer addresses element `begin`
// of its buffer (param and grad may be full buffers offset by begin, or shard-local buffers);
// m and v hold end - begin floats.
struct FlatRange {
  std::int64_t begin = 0, end = 0;
  float* param = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
};

class AdamW {
 public:
  explicit AdamW(const AdamWConfig& c);

  // One optimizer step on every AdamW parameter of `layout` that intersects the range (Muon
  // parameters and padding are skipped and left as they are). Increments the step counter
  // first, so the first call uses t = 1. Elements are split over ops threads when large.
  void step(const ParamLayout& layout, const FlatRange& range, double lr, float grad_scale = 1.0f);
  // One step over several disjoint ranges (a ZeRO-1 shard and an expert-parallel rank's experts):
  // the counter advances once.
  void step(const ParamLayout& layout, const std::vector<FlatRange>& ranges, double lr, float grad_scale = 1.0f);

  std::int64_t step_count() const { return t_; }
  void set_step_count(std::int64_t t);  // for checkpoint restore
  const AdamWConfig& config() const { return c_; }

 private:
  AdamWConfig c_;
  std::int64_t t_ = 0;
};

}  // namespace keel::optim

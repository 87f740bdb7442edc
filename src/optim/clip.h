// Global-norm gradient clipping over all parameters of all groups (as torch's
// clip_grad_norm_): norm = sqrt(sum over every gradient element of g^2), accumulated in double;
// coefficient = min(1, max_norm / (norm + 1e-6)); gradients are multiplied by it.
//
// A non-finite norm (an inf or NaN anywhere) is never applied: clip_grad_norm() throws
// NonFiniteGradient, naming the first parameter whose gradient holds one, before touching any
// gradient, so the trainer can skip the step, lower the loss scale or roll back.
//
// Fusing: instead of scaling the gradients here, pass clip_coefficient() as grad_scale to
// AdamW / Muon (one pass less over the gradients). Under ZeRO-1 / data parallelism each rank
// computes sum_squares() over the gradients it holds (after reduce-scatter: its shard), the
// partial sums are all-reduced, and norm_from_sum_squares() finishes on every rank alike.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/error.h"
#include "optim/param_groups.h"

namespace keel::optim {

class NonFiniteGradient : public Error {
 public:
  NonFiniteGradient(const std::string& what, std::string param, double norm)
      : Error(what), param_(std::move(param)), norm_(norm) {}
  const std::string& param() const { return param_; }  // first parameter with a non-finite gradient
  double norm() const { return norm_; }                // inf or NaN
 private:
  std::string param_;
  double norm_;
};

struct GradView {
  std::string name;
  float* data = nullptr;
  std::int64_t n = 0;
};

struct ClipResult {
  double norm = 0;         // the global norm before clipping
  double coefficient = 1;  // what the gradients were (or are to be) multiplied by, <= 1
  bool clipped = false;    // coefficient < 1
};

// Sum of squares of n floats, accumulated in double (inf/NaN propagate).
double sum_squares(const float* g, std::int64_t n);
// sqrt(sum_sq); throws NonFiniteGradient (param "") when it is not finite.
double norm_from_sum_squares(double sum_sq);
// min(1, max_norm / (norm + 1e-6)); max_norm <= 0 means "no clipping" (1). norm must be finite.
double clip_coefficient(double norm, double max_norm);

// Views of every parameter's gradient in a flat gradient buffer.
std::vector<GradView> grad_views(const ParamLayout& layout, float* grads);

// The global norm over all views; throws NonFiniteGradient naming the first bad parameter.
double global_grad_norm(const std::vector<GradView>& grads);
// Computes the norm and, when it exceeds max_norm (> 0), scales every gradient in place.
ClipResult clip_grad_norm(const std::vector<GradView>& grads, double max_norm);
// The same without touching the gradients: returns the coefficient to fuse as grad_scale.
ClipResult clip_grad_norm_deferred(const std::vector<GradView>& grads, double max_norm);

}  // namespace keel::optim

// Muon (MomentUm Orthogonalized by Newton-Schulz, K. Jordan et al. 2024,
// https://kellerjordan.github.io/posts/muon/) for 2-D weight matrices; 3-D parameters
// [E, rows, cols] (MoE expert stacks) are E independent matrices.
//
// At each step, with lr = scheduled lr * the parameter's lr_scale and gradient scale s:
//   g  = s * grad
//   M  = beta M + (1 - beta) g                          (momentum, fp32, starts at zero)
//   U  = (1 - beta) g + beta M   if nesterov, else M
//   O  = NS5(U)                                         (newton_schulz.h, per matrix)
//   p  = p * (1 - lr * wd) - lr * k * O                 (decoupled decay, wd = 0 if the group
//                                                         does not decay)
// The scale k makes the update RMS match AdamW's, so AdamW's lr and weight decay carry over
// ("Muon is Scalable for LLM Training", Liu et al. 2025, arXiv 2502.16982, Moonlight;
// "Muon with AdamW RMS matching" in ZAYA1's recipe):
//   kMatchAdamW: k = rms_target * sqrt(max(rows, cols)), rms_target = 0.2 (Moonlight). An exact
//     orthogonal O has min(r, c) unit singular values, so RMS(O) = sqrt(min / (r c)) =
//     1 / sqrt(max(r, c)) and RMS(k O) = rms_target; the quintic's singular values lie in
//     ~[0.68, 1.21], so the achieved RMS is rms_target x the RMS of O's singular values.
//   kExactRms:   k = rms_target / RMS(O), measured per matrix: RMS(k O) = rms_target exactly.
//   kKeller:     k = sqrt(max(1, rows / cols)) (the reference implementation; needs Muon's own lr
//                ~0.02).
//   kNone:       k = 1.
//
// Distributed use: muon_matrix_step() updates one whole matrix (or expert stack) from its full
// gradient and momentum and needs nothing else, so under ZeRO-1 the rank that owns the matrix
// runs it (parallel/zero1.h, docs/optim.md).
#pragma once

#include <cstdint>
#include <vector>

#include "optim/newton_schulz.h"
#include "optim/param_groups.h"

namespace keel::optim {

enum class MuonScale { kMatchAdamW, kExactRms, kKeller, kNone };

struct MuonConfig {
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  double weight_decay = 0.1;
  MuonScale scale = MuonScale::kMatchAdamW;
  double rms_target = 0.2;
  NsCoefficients coeffs{};
};

// Throws keel::Error (one line) on momentum outside [0, 1), ns_steps < 1, negative or
// non-finite weight_decay or rms_target <= 0.
void validate(const MuonConfig& c);

// k of the equations above for a rows x cols matrix (kExactRms: needs the NS output; this
// returns rms_target * sqrt(max(rows, cols)) as its nominal value).
double muon_scale(const MuonConfig& c, std::int64_t rows, std::int64_t cols);

// Scratch floats muon_matrix_step() needs for one rows x cols matrix.
std::int64_t muon_scratch_floats(std::int64_t rows, std::int64_t cols);

// The non-elementwise part of one Muon step on one whole rows x cols matrix: u <- NS5(u) in
// place (newton_schulz with c.ns_steps and c.coeffs), and returns the scale k of the equations
// above (kExactRms: measured on the result, 0 for a zero result). ns_scratch holds
// newton_schulz_scratch_floats(rows, cols) floats. muon_matrix_step() runs exactly this between
// its elementwise parts; tensor-parallel Muon (parallel/tensor_parallel_muon.h) runs it on the
// rank that gathered the whole matrix.
double muon_orthogonalize(float* u, std::int64_t rows, std::int64_t cols, const MuonConfig& c, float* ns_scratch);

// One Muon step on `matrices` consecutive rows x cols matrices (param, grad, momentum each
// matrices * rows * cols floats). scratch: muon_scratch_floats(rows, cols) floats.
// If update_out is not null it receives k * O (the step before lr, for tests and logging).
void muon_matrix_step(float* param, const float* grad, float* momentum, std::int64_t matrices, std::int64_t rows,
                      std::int64_t cols, const MuonConfig& c, double lr, bool decay, float grad_scale, float* scratch,
                      float* update_out = nullptr);

class Muon {
 public:
  explicit Muon(const MuonConfig& c);

  // One step on every Muon parameter of `layout` (single rank: whole flat buffers, momentum
  // indexed by the layout's offsets like params and grads). Increments the step counter.
  void step(const ParamLayout& layout, float* params, const float* grads, float* momentum, double lr,
            float grad_scale = 1.0f);
  // One step on one parameter (the unit a ZeRO-1 owner runs): views of that parameter only.
  void step_param(const ParamInfo& p, float* param, const float* grad, float* momentum, double lr,
                  float grad_scale = 1.0f);

  std::int64_t step_count() const { return t_; }
  void set_step_count(std::int64_t t);
  const MuonConfig& config() const { return c_; }

 private:
  MuonConfig c_;
  std::int64_t t_ = 0;
  std::vector<float> scratch_;
};

}  // namespace keel::optim

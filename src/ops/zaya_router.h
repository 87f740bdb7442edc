// ZAYA1's MLP router with exponential depth averaging (EDA), top-1 biased selection, the MoD
// skip class, and the non-gradient balancing-bias controller.
// Source: Zyphra transformers fork, modeling_zaya.py `ZayaRouter`, `ZayaBlock` (skip path);
// controller per docs/zaya1_ops.md (Primus implementation note). Equations, per token n:
//   a0    = x W_down^T + b_down                                 [N, D]   (D = 256 in ZAYA1)
//   a     = a0 + gamma * a_prev      (EDA; gamma [D] learned, init 1; skipped when a_prev is
//                                     empty: the first MoE stage)                  -> state
//   u     = RMSNorm_D(a; w_norm, eps)
//   h1    = GELU(u W_1^T + b_1),  h2 = GELU(h1 W_2^T + b_2)        (exact erf GELU, nn.GELU())
//   z     = h2 W_3^T                                              [N, E] (no bias)
//   p     = softmax(z) (fp32);  e* = argmax_e (p_e + beta_e) (ties: lower index);  g = p_{e*}
// `state` (= a, post-EDA and pre-norm) is passed to the next MoE stage as its a_prev; its
// gradient flows back through the chain. E counts the skip class when enabled (E = 17 in
// ZAYA1: 16 experts + class 16 = skip, whose MoE output is 0: see skip_forward).
// The selection and its bias have no gradient; the gate carries the router's gradient.
// Softmax, selection and counts are delegated to ops::router (top_k = 1, no renormalization).
//
// Gradients (docs/ops.md, Gradient convention): dx, dprev_state overwritten; parameter gradients
// accumulated (+=). Any may be empty except where noted. (Inside, the norm's dx is added onto
// dstate_next, the state's gradient from the next stage: the residual-stream pattern.)
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace keel::ops::zaya_router {

struct Params {
  Tensor w_down;  // [D, H]
  Tensor b_down;  // [D]
  Tensor gamma;   // [D] EDA scale (router_states_scale); may be empty when EDA is never used
  Tensor w_norm;  // [D] RMSNorm weight
  Tensor w1, b1;  // [D, D], [D]
  Tensor w2, b2;  // [D, D], [D]
  Tensor w3;      // [E, D]
};

// Activations saved by forward for backward, each [N, D] unless noted. The caller allocates
// them (saved_floats / carve_saved lay them out in one buffer).
struct Saved {
  Tensor state;    // a: post-EDA, pre-norm; also the forward output passed to the next stage
  Tensor rstd;     // [N]
  Tensor u;        // RMSNorm output
  Tensor z1, h1;   // pre- and post-GELU of layer 1
  Tensor z2, h2;   // pre- and post-GELU of layer 2
  Tensor logits;   // [N, E] router MLP output
  Tensor probs;    // [N, E]
  Tensor lse;      // [N]
  Tensor gates;    // [N, 1]
  std::vector<std::int32_t> idx;     // [N] chosen class (top-1)
  std::vector<std::int64_t> counts;  // [E] tokens per class (the controller's input)
};

std::int64_t saved_floats(std::int64_t n, std::int64_t d, std::int64_t e);
// Views into p (at least saved_floats floats); also sizes idx and counts.
Saved carve_saved(float* p, std::int64_t n, std::int64_t d, std::int64_t e);

// x [N, H]; prev_state [N, D] or empty (no EDA); bias [E] or empty. Fills s.
// forced_classes > 0: forced-balance selection (benchmarking only; router::Options): token n
// takes class n mod forced_classes (the experts alone, so no skip, when it is E - 1).
void forward(const Tensor& x, const Tensor& prev_state, const Params& p, const Tensor& bias, float eps, Saved& s,
             int forced_classes = 0);

// scratch: backward_scratch_floats(N, D, E) floats.
std::int64_t backward_scratch_floats(std::int64_t n, std::int64_t d, std::int64_t e);
// dgates [N, 1]: dL/dg (from the MoE combine and the skip path). dstate_next [N, D] or empty:
// dL/d(state) coming back from the next stage's EDA (and any other user of state).
// dx [N, H], dprev_state [N, D] (needs prev_state), grads: a Params of gradient views.
// d_aux: the Switch load-balancing loss's weight over all E classes (ops::router: aux = E sum_e
// f_e P_e, the gradient d_aux E f_e / N into every p[n, e]); 0: none (ZAYA1 has none). Its f_e
// are s.counts over this call's tokens, or aux_counts over aux_rows tokens where given (the
// micro-batch's counts under context parallelism: ops::router::aux_loss).
void backward(const Tensor& x, const Tensor& prev_state, const Params& p, const Saved& s, const Tensor& dgates,
              const Tensor& dstate_next, const Tensor& dx, const Tensor& dprev_state, const Params& grads,
              const Tensor& scratch, float d_aux = 0.f, const std::int64_t* aux_counts = nullptr,
              std::int64_t aux_rows = 0);

// The MoD skip path: a token routed to the skip class runs no expert and its MoE output is 0,
// so only the residual path carries it (as the maintained implementations of the released
// model do: Hugging Face transformers' modeling_zaya.py and Zyphra's vLLM mask the skip
// token's probability to 0; docs/zaya1_ops.md). Both functions write only the skip tokens'
// rows (idx[n] == skip_class) and leave every other row untouched (the caller's expert scatter
// writes those), as the CUDA twins in ops/cuda/zaya_router.h do.
// skip_forward: y[n] = 0 on skip rows (written). x, y [N, H]; gates [N, 1].
void skip_forward(const Tensor& x, const std::int32_t* idx, const Tensor& gates, int skip_class, const Tensor& y);
// skip_backward: dgates[n] = 0 and dx[n] = 0 on skip rows (written: they are activation
// gradients; the skip output does not depend on the gate or on x); other rows untouched.
// Either output may be empty.
void skip_backward(const Tensor& x, const std::int32_t* idx, const Tensor& gates, int skip_class, const Tensor& dy,
                   const Tensor& dx, const Tensor& dgates);

// Exact GELU and its derivative (erf form), exposed for tests.
float gelu(float x);
float gelu_grad(float x);

}  // namespace keel::ops::zaya_router

// The balancing-bias controller (aux-loss-free balancing): a pure function of the global class
// counts (all-reduced over data-parallel ranks by the caller) and the controller state. The
// bias is a float32 buffer outside backprop. Default: AdamW on the bias with "gradient"
// f_e - target (f_e = counts_e / sum counts, target = 1/E over all E classes including skip),
// lr 1e-3, betas (0.9, 0.999), eps 1e-8 (added to sqrt(v_hat)), Adam bias correction, no
// weight decay (AMD-AGI/Primus zaya1_modules.py `ZayaRouter._update_biases`, see
// docs/zaya1_ops.md); overloaded classes get a lower bias. Alternatives: Sign (DeepSeek-V3:
// beta -= lr * sign(f - target)), Proportional (beta -= lr * (f - target): the bias integrates
// the error) and Pid (the velocity form of a PID controller on the error e = f - target:
// beta -= lr e_t + kp (e_t - e_{t-1}) + kd (e_t - 2 e_{t-1} + e_{t-2}), so beta is -lr sum e
// - kp e_t - kd (e_t - e_{t-1}); the previous two errors are its state, 0 before the first).
namespace keel::ops::bias_controller {

enum class Rule { Adam, Sign, Proportional, Pid };

struct Config {
  Rule rule = Rule::Adam;
  double lr = 1e-3;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.f;  // decoupled (AdamW): bias *= 1 - lr * wd before the step; Adam only
  float target = -1.f;  // < 0: 1 / E
  double kp = 0, kd = 0;  // Pid's proportional and derivative gains (lr is its integral gain)
};

struct State {
  std::vector<float> bias;  // [E]
  std::vector<float> m, v;  // [E] Adam: moments; Pid: the errors of the last and the one before
                            // (unused by Sign / Proportional)
  std::int64_t step = 0;
};

// ZAYA1 init: 0 for the experts and -1 for the skip class (the last class) when skip is on.
State init(int num_classes, bool skip_class);

// One controller step. Pure: returns the next state. With no tokens (sum counts == 0) the
// state is returned unchanged. With the default target the error f_e - 1/E is computed from
// integers ((counts_e E - total) / (E total)), so a class exactly at its share has error 0.
State update(const Config& c, const State& s, const std::int64_t* counts);

}  // namespace keel::ops::bias_controller

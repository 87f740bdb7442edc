#include "ops/zaya_router.h"

#include <algorithm>

#include <cmath>
#include <cstring>

#include "common/error.h"
#include "ops/linear.h"
#include "common/parallel_for.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"

namespace keel::ops::zaya_router {

float gelu(float x) { return static_cast<float>(0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)))); }

float gelu_grad(float x) {
  const double xd = x;
  return static_cast<float>(0.5 * (1.0 + std::erf(xd / std::sqrt(2.0))) + xd * std::exp(-0.5 * xd * xd) / std::sqrt(2.0 * M_PI));
}

std::int64_t saved_floats(std::int64_t n, std::int64_t d, std::int64_t e) { return 6 * n * d + 2 * n * e + 3 * n; }

Saved carve_saved(float* p, std::int64_t n, std::int64_t d, std::int64_t e) {
  Saved s;
  auto take = [&p](std::initializer_list<std::int64_t> shape) {
    Tensor t(p, shape);
    p += t.numel();
    return t;
  };
  s.state = take({n, d});
  s.rstd = take({n});
  s.u = take({n, d});
  s.z1 = take({n, d});
  s.h1 = take({n, d});
  s.z2 = take({n, d});
  s.h2 = take({n, d});
  s.logits = take({n, e});
  s.probs = take({n, e});
  s.lse = take({n});
  s.gates = take({n, 1});
  s.idx.assign(static_cast<std::size_t>(n), 0);
  s.counts.assign(static_cast<std::size_t>(e), 0);
  return s;
}

namespace {
void gelu_inplace(const Tensor& z, const Tensor& h) {
  parallel_for(z.numel(), 4096, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) h[i] = gelu(z[i]);
  });
}
}  // namespace

void forward(const Tensor& x, const Tensor& prev_state, const Params& p, const Tensor& bias, float eps, Saved& s,
             int forced_classes) {
  if (x.ndim() != 2) fail("zaya_router: x must be [N, H], got {}", x.shape_string());
  if (p.w_down.ndim() != 2 || p.w3.ndim() != 2) fail("zaya_router: w_down and w3 must be 2-D");
  const std::int64_t n = x.dim(0), d = p.w_down.dim(0), e = p.w3.dim(0);
  require_shape(s.state, {n, d}, "zaya_router state");
  require_shape(s.probs, {n, e}, "zaya_router probs");
  if (static_cast<std::int64_t>(s.idx.size()) != n || static_cast<std::int64_t>(s.counts.size()) != e)
    fail("zaya_router: Saved idx/counts sized {}/{}, need {}/{}", s.idx.size(), s.counts.size(), n, e);
  linear::forward(x, p.w_down, p.b_down, s.state);
  if (!prev_state.empty()) {
    require_shape(prev_state, {n, d}, "zaya_router prev_state");
    require_shape(p.gamma, {d}, "zaya_router gamma (EDA needs it)");
    parallel_for(n, 256, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i)
        for (std::int64_t j = 0; j < d; ++j) s.state.row(i)[j] += p.gamma[j] * prev_state.row(i)[j];
    });
  }
  rmsnorm::forward(s.state, p.w_norm, eps, s.u, s.rstd);
  linear::forward(s.u, p.w1, p.b1, s.z1);
  gelu_inplace(s.z1, s.h1);
  linear::forward(s.h1, p.w2, p.b2, s.z2);
  gelu_inplace(s.z2, s.h2);
  linear::forward(s.h2, p.w3, Tensor(), s.logits);
  router::Options o;
  o.top_k = 1;
  o.renormalize = false;
  o.forced_classes = forced_classes;
  router::forward(s.logits, bias, o, s.probs, s.lse, s.idx.data(), s.gates, s.counts.data());
}

std::int64_t backward_scratch_floats(std::int64_t n, std::int64_t d, std::int64_t e) { return n * e + 2 * n * d; }

void backward(const Tensor& x, const Tensor& prev_state, const Params& p, const Saved& s, const Tensor& dgates,
              const Tensor& dstate_next, const Tensor& dx, const Tensor& dprev_state, const Params& g,
              const Tensor& scratch, float d_aux, const std::int64_t* aux_counts, std::int64_t aux_rows) {
  const std::int64_t n = x.dim(0), d = p.w_down.dim(0), e = p.w3.dim(0);
  require_shape(dgates, {n, 1}, "zaya_router dgates");
  if (scratch.numel() < backward_scratch_floats(n, d, e))
    fail("zaya_router backward: scratch has {} floats, needs {}", scratch.numel(), backward_scratch_floats(n, d, e));
  float* sp = scratch.data();
  Tensor dlogits(sp, {n, e}), b1(sp + n * e, {n, d}), b2(sp + n * e + n * d, {n, d});
  router::Options o;
  o.top_k = 1;
  router::backward(s.probs, s.lse, s.idx.data(), s.gates, aux_counts ? aux_counts : s.counts.data(), o, dgates, d_aux,
                   0.f, dlogits, aux_counts ? aux_rows : 0);
  linear::backward(s.h2, p.w3, dlogits, b1, g.w3, Tensor());  // b1 = dh2
  for (std::int64_t i = 0; i < n * d; ++i) b1[i] *= gelu_grad(s.z2[i]);  // dz2
  linear::backward(s.h1, p.w2, b1, b2, g.w2, g.b2);  // b2 = dh1
  for (std::int64_t i = 0; i < n * d; ++i) b2[i] *= gelu_grad(s.z1[i]);  // dz1
  linear::backward(s.u, p.w1, b2, b1, g.w1, g.b1);  // b1 = du
  // da = dstate_next (or 0) + this stage's share: RMSNorm backward adds into its dx.
  if (!dstate_next.empty()) {
    require_shape(dstate_next, {n, d}, "zaya_router dstate_next");
    std::memcpy(b2.data(), dstate_next.data(), sizeof(float) * static_cast<std::size_t>(n * d));
  } else {
    b2.zero();
  }
  rmsnorm::backward(s.state, p.w_norm, s.rstd, b1, b2, g.w_norm);  // b2 = da
  if (!prev_state.empty()) {
    require_shape(prev_state, {n, d}, "zaya_router prev_state");
    if (!g.gamma.empty()) {
      require_shape(g.gamma, {d}, "zaya_router dgamma");
      for (std::int64_t j = 0; j < d; ++j) {
        double acc = 0;
        for (std::int64_t i = 0; i < n; ++i) acc += double(b2.row(i)[j]) * prev_state.row(i)[j];
        g.gamma[j] += static_cast<float>(acc);
      }
    }
    if (!dprev_state.empty()) {
      require_shape(dprev_state, {n, d}, "zaya_router dprev_state");
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = 0; j < d; ++j) dprev_state.row(i)[j] = b2.row(i)[j] * p.gamma[j];
    }
  } else if (!dprev_state.empty()) {
    dprev_state.zero();
  }
  linear::backward(x, p.w_down, b2, dx, g.w_down, g.b_down);
}

void skip_forward(const Tensor& x, const std::int32_t* idx, const Tensor& gates, int skip_class, const Tensor& y) {
  if (x.ndim() != 2) fail("zaya_router skip: x must be [N, H], got {}", x.shape_string());
  const std::int64_t n = x.dim(0), h = x.dim(1);
  require_shape(gates, {n, 1}, "zaya_router skip gates");
  require_shape(y, {n, h}, "zaya_router skip y");
  for (std::int64_t i = 0; i < n; ++i)
    if (idx[i] == skip_class) std::fill(y.row(i), y.row(i) + h, 0.f);  // other rows: left untouched
}

void skip_backward(const Tensor& x, const std::int32_t* idx, const Tensor& gates, int skip_class, const Tensor& dy,
                   const Tensor& dx, const Tensor& dgates) {
  if (x.ndim() != 2) fail("zaya_router skip: x must be [N, H], got {}", x.shape_string());
  const std::int64_t n = x.dim(0), h = x.dim(1);
  require_shape(gates, {n, 1}, "zaya_router skip gates");
  require_shape(dy, {n, h}, "zaya_router skip dy");
  if (!dgates.empty()) require_shape(dgates, {n, 1}, "zaya_router skip dgates");
  if (!dx.empty()) require_shape(dx, {n, h}, "zaya_router skip dx");
  for (std::int64_t i = 0; i < n; ++i) {
    if (idx[i] != skip_class) continue;  // not a skip row: left untouched
    if (!dgates.empty()) dgates[i] = 0.f;
    if (!dx.empty()) std::fill(dx.row(i), dx.row(i) + h, 0.f);
  }
}

}  // namespace keel::ops::zaya_router

namespace keel::ops::bias_controller {

State init(int num_classes, bool skip_class) {
  if (num_classes < 1 + int(skip_class)) fail("bias_controller: {} classes is too few", num_classes);
  State s;
  s.bias.assign(static_cast<std::size_t>(num_classes), 0.f);
  if (skip_class) s.bias.back() = -1.f;
  s.m.assign(s.bias.size(), 0.f);
  s.v.assign(s.bias.size(), 0.f);
  return s;
}

State update(const Config& c, const State& s, const std::int64_t* counts) {
  const std::size_t e = s.bias.size();
  if (s.m.size() != e || s.v.size() != e) fail("bias_controller: state vectors of unequal size");
  std::int64_t total = 0;
  for (std::size_t i = 0; i < e; ++i) {
    if (counts[i] < 0) fail("bias_controller: negative count {} for class {}", counts[i], i);
    total += counts[i];
  }
  if (total == 0) return s;
  State out = s;
  const double target = c.target < 0 ? 1.0 / double(e) : double(c.target);
  out.step = s.step + 1;
  const double bc1 = 1.0 - std::pow(double(c.beta1), double(out.step));
  const double bc2 = 1.0 - std::pow(double(c.beta2), double(out.step));
  for (std::size_t i = 0; i < e; ++i) {
    const double err = c.target < 0 ? (double(counts[i]) * double(e) - double(total)) / (double(e) * double(total))
                                     : double(counts[i]) / double(total) - target;  // > 0: overloaded
    double step = 0;  // the bias goes down by it
    switch (c.rule) {
      case Rule::Adam: {
        const double m = c.beta1 * double(s.m[i]) + (1.0 - c.beta1) * err;
        const double v = c.beta2 * double(s.v[i]) + (1.0 - c.beta2) * err * err;
        out.m[i] = static_cast<float>(m);
        out.v[i] = static_cast<float>(v);
        step = c.lr * (m / bc1) / (std::sqrt(v / bc2) + c.eps);
        break;
      }
      case Rule::Sign:
        step = c.lr * (err > 0 ? 1.0 : (err < 0 ? -1.0 : 0.0));
        break;
      case Rule::Proportional:
        step = c.lr * err;
        break;
      case Rule::Pid: {
        const double e1 = s.m[i], e2 = s.v[i];
        step = c.lr * err + c.kp * (err - e1) + c.kd * (err - 2.0 * e1 + e2);
        out.m[i] = static_cast<float>(err);
        out.v[i] = static_cast<float>(e1);
        break;
      }
    }
    double b = s.bias[i];
    if (c.rule == Rule::Adam && c.weight_decay != 0.f) b *= 1.0 - c.lr * c.weight_decay;
    out.bias[i] = static_cast<float>(b - step);
  }
  return out;
}

}  // namespace keel::ops::bias_controller

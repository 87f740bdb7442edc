#include "ops/causal_conv.h"

#include <vector>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::causal_conv {

namespace {
void check_depthwise(const Tensor& x, const Tensor& w, int extra, const Tensor& y, const char* ywhat) {
  if (x.ndim() != 3) fail("causal_conv depthwise: x must be [B, T, C], got {}", x.shape_string());
  if (w.ndim() != 2 || w.dim(0) != x.dim(2) || w.dim(1) < 1)
    fail("causal_conv depthwise: w must be [C={}, W>=1], got {}", x.dim(2), w.shape_string());
  if (extra < 0) fail("causal_conv depthwise: extra must be >= 0, got {}", extra);
  require_shape(y, {x.dim(0), x.dim(1) + extra, x.dim(2)}, ywhat);
}
// The input at time ts (< T) of sequence bi, or nullptr where it is zero (before time 0, no halo).
inline const float* depthwise_input(const Tensor& x, const Tensor& halo, std::int64_t P, std::int64_t bi,
                                    std::int64_t ts) {
  const std::int64_t T = x.dim(1), C = x.dim(2);
  if (ts >= 0) return x.data() + (bi * T + ts) * C;
  if (halo.empty()) return nullptr;
  return halo.data() + (bi * P + ts + P) * C;  // ts >= -P always
}
void check_grouped(const Tensor& x, const Tensor& w, int lead, const Tensor& y, const char* ywhat) {
  if (x.ndim() != 3) fail("causal_conv grouped: x must be [B, T + lead, C], got {}", x.shape_string());
  const std::int64_t c = x.dim(2);
  if (w.ndim() != 3 || w.dim(0) != c || w.dim(1) < 1 || c % w.dim(1) != 0 || w.dim(2) < 1)
    fail("causal_conv grouped: w must be [C={}, Cg (dividing C), W>=1], got {}", c, w.shape_string());
  if (lead < 0 || lead > x.dim(1)) fail("causal_conv grouped: lead {} outside [0, {}]", lead, x.dim(1));
  require_shape(y, {x.dim(0), x.dim(1) - lead, c}, ywhat);
}
}  // namespace

void depthwise_forward(const Tensor& x, const Tensor& w, const Tensor& b, int extra, const Tensor& y,
                       const Tensor& halo) {
  check_depthwise(x, w, extra, y, "causal_conv depthwise y");
  const std::int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2), W = w.dim(1), To = T + extra, P = extra + W - 1;
  if (!b.empty()) require_shape(b, {C}, "causal_conv depthwise b");
  if (!halo.empty()) require_shape(halo, {B, P, C}, "causal_conv depthwise halo");
  parallel_for(B * To, 64, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const std::int64_t bi = r / To, t = r % To - extra;
      float* yr = y.data() + r * C;
      for (std::int64_t c = 0; c < C; ++c) yr[c] = b.empty() ? 0.f : b[c];
      for (std::int64_t k = 0; k < W; ++k) {
        const float* xr = depthwise_input(x, halo, P, bi, t - (W - 1) + k);
        if (!xr) continue;
        for (std::int64_t c = 0; c < C; ++c) yr[c] += w.data()[c * W + k] * xr[c];
      }
    }
  });
}

void depthwise_backward(const Tensor& x, const Tensor& w, int extra, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                        const Tensor& db, const Tensor& halo, const Tensor& dhalo) {
  check_depthwise(x, w, extra, dy, "causal_conv depthwise dy");
  const std::int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2), W = w.dim(1), To = T + extra, P = extra + W - 1;
  if (!halo.empty()) require_shape(halo, {B, P, C}, "causal_conv depthwise halo");
  if (!dhalo.empty()) require_shape(dhalo, {B, P, C}, "causal_conv depthwise dhalo");
  if (!dx.empty()) require_shape(dx, {B, T, C}, "causal_conv depthwise dx");
  // Input time s (s < 0: the halo's row s + P) feeds output time t = s + (W-1) - k, i.e. row
  // j = t + extra.
  const std::int64_t Ti = (dx.empty() ? 0 : T) + (dhalo.empty() ? 0 : P);  // input rows per sequence
  if (Ti > 0) {
    const std::int64_t s0 = dhalo.empty() ? 0 : -P;  // times s0 .. s0 + Ti - 1
    parallel_for(B * Ti, 64, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) {
        const std::int64_t bi = r / Ti, s = s0 + r % Ti;
        float* dxr = s >= 0 ? dx.data() + (bi * T + s) * C : dhalo.data() + (bi * P + s + P) * C;
        for (std::int64_t c = 0; c < C; ++c) dxr[c] = 0.f;
        for (std::int64_t k = 0; k < W; ++k) {
          const std::int64_t j = s + (W - 1) - k + extra;
          if (j < 0 || j >= To) continue;
          const float* g = dy.data() + (bi * To + j) * C;
          for (std::int64_t c = 0; c < C; ++c) dxr[c] += w.data()[c * W + k] * g[c];
        }
      }
    });
  }
  if (!dw.empty() || !db.empty()) {
    if (!dw.empty()) require_shape(dw, {C, W}, "causal_conv depthwise dw");
    if (!db.empty()) require_shape(db, {C}, "causal_conv depthwise db");
    parallel_for(C, 16, [&](std::int64_t lo, std::int64_t hi) {
      std::vector<double> acc(static_cast<std::size_t>(W));
      for (std::int64_t c = lo; c < hi; ++c) {
        std::fill(acc.begin(), acc.end(), 0.0);
        double accb = 0;
        for (std::int64_t bi = 0; bi < B; ++bi)
          for (std::int64_t j = 0; j < To; ++j) {
            const double g = dy.data()[(bi * To + j) * C + c];
            accb += g;
            const std::int64_t t = j - extra;
            for (std::int64_t k = 0; k < W; ++k) {
              const float* xr = depthwise_input(x, halo, P, bi, t - (W - 1) + k);
              if (xr) acc[k] += g * xr[c];
            }
          }
        if (!dw.empty())
          for (std::int64_t k = 0; k < W; ++k) dw.data()[c * W + k] += static_cast<float>(acc[k]);
        if (!db.empty()) db[c] += static_cast<float>(accb);
      }
    });
  }
}

void grouped_forward(const Tensor& x, const Tensor& w, const Tensor& b, int lead, const Tensor& y) {
  check_grouped(x, w, lead, y, "causal_conv grouped y");
  const std::int64_t B = x.dim(0), Ti = x.dim(1), C = x.dim(2), Cg = w.dim(1), W = w.dim(2), T = Ti - lead;
  if (!b.empty()) require_shape(b, {C}, "causal_conv grouped b");
  parallel_for(B * T, 16, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const std::int64_t bi = r / T, t = r % T;
      float* yr = y.data() + r * C;
      for (std::int64_t o = 0; o < C; ++o) {
        const std::int64_t g0 = (o / Cg) * Cg;
        double acc = b.empty() ? 0.0 : double(b[o]);
        for (std::int64_t k = 0; k < W; ++k) {
          const std::int64_t row = t + lead - (W - 1) + k;
          if (row < 0) continue;
          const float* xr = x.data() + (bi * Ti + row) * C + g0;
          const float* wr = w.data() + o * Cg * W + k;
          for (std::int64_t i = 0; i < Cg; ++i) acc += double(wr[i * W]) * xr[i];
        }
        yr[o] = static_cast<float>(acc);
      }
    }
  });
}

void grouped_backward(const Tensor& x, const Tensor& w, int lead, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                      const Tensor& db) {
  check_grouped(x, w, lead, dy, "causal_conv grouped dy");
  const std::int64_t B = x.dim(0), Ti = x.dim(1), C = x.dim(2), Cg = w.dim(1), W = w.dim(2), T = Ti - lead;
  if (!dx.empty()) {
    require_shape(dx, {B, Ti, C}, "causal_conv grouped dx");
    // Input row i feeds output t = i - lead + (W-1) - k through tap k.
    parallel_for(B * Ti, 16, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) {
        const std::int64_t bi = r / Ti, i = r % Ti;
        float* dxr = dx.data() + r * C;
        for (std::int64_t c = 0; c < C; ++c) {
          const std::int64_t g0 = (c / Cg) * Cg, ci = c - g0;
          double acc = 0;
          for (std::int64_t k = 0; k < W; ++k) {
            const std::int64_t t = i - lead + (W - 1) - k;
            if (t < 0 || t >= T) continue;
            const float* g = dy.data() + (bi * T + t) * C;
            for (std::int64_t o = g0; o < g0 + Cg; ++o) acc += double(w.data()[(o * Cg + ci) * W + k]) * g[o];
          }
          dxr[c] = static_cast<float>(acc);
        }
      }
    });
  }
  if (!dw.empty() || !db.empty()) {
    if (!dw.empty()) require_shape(dw, {C, Cg, W}, "causal_conv grouped dw");
    if (!db.empty()) require_shape(db, {C}, "causal_conv grouped db");
    // One output channel per task: no two threads write the same dw / db element.
    parallel_for(C, 8, [&](std::int64_t lo, std::int64_t hi) {
      std::vector<double> acc(static_cast<std::size_t>(Cg * W));
      for (std::int64_t o = lo; o < hi; ++o) {
        const std::int64_t g0 = (o / Cg) * Cg;
        std::fill(acc.begin(), acc.end(), 0.0);
        double accb = 0;
        for (std::int64_t bi = 0; bi < B; ++bi)
          for (std::int64_t t = 0; t < T; ++t) {
            const double g = dy.data()[(bi * T + t) * C + o];
            accb += g;
            for (std::int64_t k = 0; k < W; ++k) {
              const std::int64_t row = t + lead - (W - 1) + k;
              if (row < 0) continue;
              const float* xr = x.data() + (bi * Ti + row) * C + g0;
              for (std::int64_t i = 0; i < Cg; ++i) acc[i * W + k] += g * xr[i];
            }
          }
        if (!dw.empty())
          for (std::int64_t j = 0; j < Cg * W; ++j) dw.data()[o * Cg * W + j] += static_cast<float>(acc[j]);
        if (!db.empty()) db[o] += static_cast<float>(accb);
      }
    });
  }
}

}  // namespace keel::ops::causal_conv

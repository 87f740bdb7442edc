#include "ops/swiglu.h"

#include <cmath>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::swiglu {

namespace {
inline float sigmoid(float g) { return 1.f / (1.f + std::exp(-g)); }

void require_same(const Tensor& a, const Tensor& b, const char* what) {
  if (a.numel() != b.numel() || a.shape_string() != b.shape_string())
    fail("swiglu: {} has shape {}, expected {}", what, b.shape_string(), a.shape_string());
}
}  // namespace

void forward_n(const float* gate, const float* up, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

void backward_n(const float* gate, const float* up, const float* dout, float* dgate, float* dup, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = gate[i], s = sigmoid(g);
    // Read everything before writing: dgate/dup may alias gate/up in a caller reusing buffers.
    const float u = up[i], d = dout[i];
    if (dup) dup[i] = d * g * s;
    if (dgate) dgate[i] = d * u * s * (1.f + g * (1.f - s));
  }
}

void forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  require_same(gate, up, "up");
  require_same(gate, out, "out");
  parallel_for(gate.numel(), 1 << 16, [&](std::int64_t b, std::int64_t e) {
    forward_n(gate.data() + b, up.data() + b, out.data() + b, e - b);
  });
}

void backward(const Tensor& gate, const Tensor& up, const Tensor& dout, const Tensor& dgate, const Tensor& dup) {
  require_same(gate, up, "up");
  require_same(gate, dout, "dout");
  if (!dgate.empty()) require_same(gate, dgate, "dgate");
  if (!dup.empty()) require_same(gate, dup, "dup");
  parallel_for(gate.numel(), 1 << 16, [&](std::int64_t b, std::int64_t e) {
    backward_n(gate.data() + b, up.data() + b, dout.data() + b, dgate.empty() ? nullptr : dgate.data() + b,
               dup.empty() ? nullptr : dup.data() + b, e - b);
  });
}

}  // namespace keel::ops::swiglu

// Sizing rules checked against every GEMM of a layer (arXiv 2401.14489's co-design rules,
// NVIDIA's tile/wave quantization): each finding says what it costs and how to fix it.
#pragma once

#include <string>
#include <vector>

#include "size/estimate.h"

namespace keel::size {

struct Finding {
  std::string rule;      // "alignment", "wave", "tokens", "heads", "tp", "vocab", "swiglu", "experts"
  std::string where;     // the GEMM or config key
  std::string severity;  // "warn" (costs throughput), "info" (worth knowing), "ok"
  std::string message;
  std::string fix;       // concrete change, e.g. "expert_hidden 10922 -> 10944"
  double predicted_gain = 0;  // fractional throughput gain of the GEMMs concerned (0.46 = +46%)
};

std::vector<Finding> check_sizing(const Setup& s);

// The SwiGLU width search near `width` (for hidden h, 8/3*h when width is 0): the width with
// the best predicted throughput of its up/gate + down GEMMs (fwd + bwd) per useful FLOP,
// among multiples of 64 within 10%. Exposed for tests.
struct WidthChoice {
  std::int64_t width = 0;
  double tflops = 0;  // predicted, over the MLP's GEMMs
};
WidthChoice mlp_throughput(const hw::GemmModel& gm, std::int64_t tokens, int hidden, std::int64_t width,
                           std::int64_t batch);
WidthChoice best_swiglu_width(const hw::GemmModel& gm, std::int64_t tokens, int hidden, std::int64_t width,
                              std::int64_t batch);

}  // namespace keel::size

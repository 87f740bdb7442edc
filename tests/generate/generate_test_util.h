// Pieces shared by the decoder tests (generate_test.cc on the CPU, generate_cuda_test.cc on the
// GPU): perturbing a fresh model's weights so no initial value hides a wrong state, sliding-window
// layers, random token ids, the largest magnitude.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "generate/generate.h"
#include "train/model.h"

namespace keel::generate::test_util {

// Every 1-D parameter (norms, biases, residual scales, conv biases, temperatures) perturbed away
// from its init, and the MLP router's matrices widened so tokens spread over the classes. Draws
// from `n(rng)`, which the caller goes on using for the router biases.
inline void perturb_weights(ModelWeights& w, const model::ModelConfig& cfg, std::mt19937& rng,
                            std::normal_distribution<float>& n) {
  for (const auto& p : model::param_layout(cfg).params) {
    // Scales around 1; biases small next to the activations, so tokens still differ.
    const float noise = p.name.ends_with("bias") ? 0.03f : 0.2f;
    if (p.ndim() == 1)
      for (std::int64_t i = 0; i < p.numel; ++i) w.params[p.offset + i] += noise * n(rng);
    // The MLP router's small init gives near-uniform, token-independent probabilities.
    if (p.ndim() == 2 && p.name.find("moe.router.") != std::string::npos)
      for (std::int64_t i = 0; i < p.numel; ++i) w.params[p.offset + i] *= 8.f;
  }
}

// cfg with sliding-window layers (ZAYA1's "hybrid_sliding"): layers 1 and 2 of every 3 attend
// to the last `window` tokens, with their own RoPE base and fraction (rotary_fraction the other
// side of 1/2 from the model's, so both tables are live).
inline model::ModelConfig with_sliding(model::ModelConfig cfg, int window) {
  cfg.name += "-sliding";
  cfg.layer_sliding = {false, true, true};
  cfg.sliding_window = window;
  cfg.sliding_rope_base = 500.0;
  cfg.sliding_rope_fraction = cfg.rope_fraction > 0.5 ? 0.5 : 1.0;
  model::validate(cfg);
  return cfg;
}

inline std::vector<std::uint32_t> random_tokens(std::int64_t n, std::int64_t vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint32_t> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = static_cast<std::uint32_t>(rng() % vocab);
  return t;
}

inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

}  // namespace keel::generate::test_util

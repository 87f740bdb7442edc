// Which GEMMs `keel bench gemm` times: ranges of m, n, k (to show tile and wave
// quantization), a list of explicit shapes, or the GEMMs of one transformer/MoE layer derived
// from model dimensions (model/config.h's layer_gemms, from a YAML file or from flags).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/gemm/types.h"
#include "model/config.h"

namespace keel::bench {

struct GemmShape {
  std::string name;  // layer mode: "qkv", "expert_down", ...; else empty
  std::string pass;  // layer mode: "fwd", "bwd_data", "bwd_weight"; else empty
  std::int64_t m = 0, n = 0, k = 0, batch = 1;
  std::int64_t layers = 1;  // layer mode: layers of the model that run this GEMM
  Layout layout = Layout::kNN;

  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) *
                                static_cast<double>(batch); }
};

// "4096" | "1024,2048,4096" | "256:8192:256" (start:stop:step, stop included when reached).
// Every value must be positive; throws keel::Error naming `what`.
std::vector<std::int64_t> parse_dim_spec(std::string_view text, std::string_view what);

// Every combination of the values of m, n and k.
std::vector<GemmShape> shapes_from_ranges(const std::vector<std::int64_t>& ms, const std::vector<std::int64_t>& ns,
                                          const std::vector<std::int64_t>& ks, Layout layout);
// m = n = k = s for each s (square sweeps).
std::vector<GemmShape> square_shapes(const std::vector<std::int64_t>& sizes, Layout layout);
// "MxNxK[xBATCH],..." e.g. "8192x8192x8192,1024x4096x2048x16".
std::vector<GemmShape> parse_shape_list(std::string_view text, Layout layout);

// The GEMMs layer_gemms() lists, laid out as training runs them: forward X W^T ("nt", W stored
// [out x in]), bwd_data dY W ("nn"), bwd_weight X^T dY ("tn").
std::vector<GemmShape> shapes_from_model(const model::ModelConfig& config, std::int64_t tokens, bool backward);

// Model dimensions given as flags; empty means not given (a default applies), and a given
// value must be positive: `--heads 0` is an error, not "not given".
struct ModelDims {
  std::optional<int> hidden, heads, kv_heads, head_dim, ffn;
  std::optional<int> experts, top_k, expert_width, router_width;
  std::optional<std::int64_t> vocab;
};
bool any_given(const ModelDims& d);
// A ModelConfig with one layer of each kind the dimensions describe (a dense MLP layer with
// --ffn, an MoE layer with --experts, both when both are given), validated like a YAML file.
// A given dimension that is not positive is an error naming its flag.
// Without --vocab the LM head is left out (`*has_lm_head` = false).
model::ModelConfig config_from_dims(const ModelDims& d, bool* has_lm_head);

}  // namespace keel::bench

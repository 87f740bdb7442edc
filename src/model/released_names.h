// ZAYA1's released parameter names: which keel parameter (model::param_layout) each tensor of
// Zyphra's Hugging Face implementation is made of, for both released layouts. The schema's third
// part beside the layout and the initialization (model/param_layout.h); keel ckpt export|import
// (ckpt/zaya_names.h) move the bytes by it.
//
// Two released layouts exist, both from Zyphra's transformers fork (github.com/Zyphra/
// transformers), and both are supported:
//   zaya1              branch `zaya1`, models/zaya/modeling_zaya.py (`ZayaForCausalLM`, the
//                      transformers-native layout): one decoder layer per keel layer (attention
//                      then MoE), experts stored as stacked [E, 2F, D] / [E, D, F] tensors.
//   zaya1-alternating  the original alternating-layer layout (branch `zaya1-legacy`, and the
//                      source layout of the fork's convert_zaya_weights_to_hf.py): 2L stages,
//                      even = CCA attention, odd = MoE, one module per expert. Third-party
//                      loaders (vLLM, SGLang, MLX ports) read the Zyphra/ZAYA1-8B Hub checkpoint
//                      in this layout.
// Which layout the Hub checkpoints hold today was not verified here (no Hub access): the fork's
// converter exists to turn the second into the first. The rules of each are in released_names.cc,
// one per released tensor with what the release does.
//
// A mapping is a list of rules. Each released tensor is the row-major concatenation of
// `pieces`, each a block of rows (along dim 0) of one keel checkpoint tensor, so splits (keel's
// fused [linear_q; linear_k] -> q_proj + k_proj), stacking (keel's w_gate and w_up [E, F, D] ->
// gate_up_proj [E, 2F, D] interleaved per expert) and per-expert tensors are all the same
// operation, exact in both directions. No transposes are needed: keel already stores every
// weight in PyTorch's [out, in] (and Conv1d [C_out, C_in / groups, W]) layout.
//
// Keel tensors covered: every `model/<param>` of model::param_layout(cfg) exactly once,
// and `router/bias.<i>` (the balancing biases, fp32 buffers in the release: `optional`, carried
// when present). With tied embeddings a released `lm_head.weight` is accepted and dropped on
// import (the tie makes it the embedding) and never written on export.
//
// The forward the weights meet: keel zeroes the skip class's output as the zaya1 branch (and
// transformers, Zyphra's vLLM) do; the alternating-layer code and Primus return g * x there.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"

namespace keel::model::released {

using Shape = std::vector<std::int64_t>;  // the same type as ckpt::Shape


enum class Names { kZaya1, kZaya1Alternating };
Names parse_names(std::string_view s);  // "zaya1" | "zaya1-alternating"; keel::UsageError otherwise
const char* to_string(Names n);

// Rows [row0, row0 + rows) along dim 0 of the keel checkpoint tensor `keel` (e.g. "model/embed.weight").
struct Piece {
  std::string keel;
  std::int64_t row0 = 0, rows = 0;
};

struct Rule {
  std::string released;  // e.g. "model.layers.3.mlp.experts.gate_up_proj"
  Shape shape;           // released shape
  std::vector<Piece> pieces;
  bool optional = false;  // carried when present on the source side (balancing biases)
};

struct KeelTensor {
  std::string name;  // checkpoint name: "model/<param>" or "router/bias.<i>"
  Shape shape;
};

struct NameMap {
  Names names = Names::kZaya1;
  std::vector<KeelTensor> keel;                // every keel tensor the rules read or write
  std::vector<Rule> rules;                     // in the release's module order
  std::vector<std::string> dropped_on_import;  // released names accepted and ignored (tied lm_head.weight)

  const Rule* find(const std::string& released) const;  // nullptr when not a released name
  const KeelTensor& keel_tensor(const std::string& name) const;
};

// The mapping for a model config. Throws keel::UsageError naming the model when the config is
// not ZAYA1-shaped: every layer CCA + MoE with the 3-layer MLP router (top-1; the zaya1 layout
// also needs the skip class), residual scaling, no shared experts or qk_norm.
NameMap build_name_map(const model::ModelConfig& cfg, Names names);

// Every element of every keel tensor covered by exactly one piece, every rule's pieces filling
// its released shape exactly, released names unique. Throws keel::Error naming the tensor.
void check_coverage(const NameMap& map);

// The config.json beside the weights, both ways: model/released_config.h.

// Elements per dim-0 row of a shape (0 for a scalar or no rows): a piece's rows times this is
// its element count.
std::int64_t row_numel(const Shape& s);

// For a name of the other layout, a hint naming the --names that reads it; "" otherwise.
std::string layout_hint(const std::string& name, Names names);

}  // namespace keel::model::released

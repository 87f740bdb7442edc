// ZAYA1 weights in and out: keel's checkpoint tensors <-> the parameter names and layouts of
// Zyphra's Hugging Face implementation, so a keel-trained ZAYA1 loads in the ecosystem's tools
// and released ZAYA1 weights start a keel run (`keel ckpt export|import --names ...`,
// docs/checkpoint.md "ZAYA1 weights").
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
// converter exists to turn the second into the first. The rules of each are in zaya_names.cc,
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
// What the mapping cannot fix: the zaya1 branch's router masks the skip class's output to 0,
// where keel (like the alternating-layer code and Primus) returns g * x for skip-routed tokens;
// the weights are the same, the forward differs for skip-routed tokens (docs/zaya1_ops.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "ckpt/types.h"
#include "model/config.h"

namespace keel::ckpt::zaya {

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

// The Hugging Face config.json of the layout (model_type "zaya", the fork's keys); `dtype`:
// "float32" or "bfloat16". Values keel's config does not hold (token ids) are the fork's
// defaults.
nlohmann::json hf_config(const model::ModelConfig& cfg, Names names, std::string_view dtype);

// --dtype of export: "fp32" (default) or "bf16" (round to nearest even); also f32/float32,
// bfloat16. Throws keel::UsageError otherwise.
ElemType parse_export_dtype(std::string_view s);

struct ZayaStats {
  std::uint64_t tensors = 0, bytes = 0;
  std::int64_t step = 0;
  std::string path;    // the safetensors file written / the checkpoint directory committed
  std::string config;  // export: the config.json written beside it
};

// Reads the `model/` tensors (and `router/bias.<i>` when present) of the keel checkpoint `src`
// (a step directory or a root) and writes them under the released names into one safetensors
// file `out` (a name not ending in .safetensors is a directory: `out`/model.safetensors), streamed one released tensor at
// a time, plus config.json beside it. The balancing biases stay fp32 (the release keeps them
// fp32 buffers); everything else is written as `dtype`. Throws keel::Error naming the tensor on
// a missing keel tensor or a shape that does not match `cfg`. Both output files are checked
// with check_export_target (an existing one is replaced only with `overwrite`).
ZayaStats export_zaya_safetensors(const std::string& src, const std::string& out, const model::ModelConfig& cfg,
                                  Names names, ElemType dtype, int threads, bool overwrite = false);

// Reads released weights and commits a keel checkpoint under the new root `dst`
// (require_new_root) at `step` (nullopt: the keel.step a keel export recorded in the file's
// __metadata__, else 0) holding fp32
// `model/<param>` tensors (and `router/bias.<i>` when the release has the balancing biases).
// `in`: a .safetensors file, or a directory holding model.safetensors.index.json (sharded
// release) or model.safetensors. Accepts F32, BF16 and F16 tensors. Throws keel::Error naming
// the tensor for an unknown released name (with a hint when it belongs to the other layout), a
// missing one, a duplicate, a wrong shape or a non-float dtype. Holds the whole model in fp32
// in memory (twice while the checkpoint is staged).
ZayaStats import_zaya_safetensors(const std::string& in, const std::string& dst, const model::ModelConfig& cfg,
                                  Names names, std::optional<std::int64_t> step, int threads);

}  // namespace keel::ckpt::zaya

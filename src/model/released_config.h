// ZAYA1's Hugging Face config.json in both directions: the one keel ckpt export --names writes
// beside the weights (hf_config), and the keel model a release's config.json describes
// (model_of_hf_config), its inverse: export then import gives the model config back exactly.
//
// zaya1: the keys of transformers' ZayaConfig (models/zaya/configuration_zaya.py, checkpoint
// Zyphra/ZAYA1-8B; absent keys take its defaults, which are the release's) plus the fork's
// Megatron-style keys keel's export also writes, which must then agree. zaya1-alternating: the
// legacy fork config's keys (branch zaya1-legacy: 2L stages, cca_num_q_heads, ...). The key
// table, and the keys refused, are in docs/checkpoint.md ("config.json").
#pragma once

#include <string>
#include <string_view>

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/released_names.h"

namespace keel::model::released {

// The tokenizer's special ids config.json names (pad_token_id, bos_token_id, eos_token_id): keel's
// model config holds none. Unset: null in config.json.
struct TokenIds {
  std::optional<std::int64_t> pad, bos, eos;
};
// The ids config.json gets when the exporter is told none: the release's (Gemma-3 tokenizer: pad
// 0, bos 2, eos 106) for the release's vocabulary of 262,272, else none (a byte-tokenizer model's
// id 106 is the letter 'j': Hugging Face's generate would stop on it).
TokenIds default_token_ids(const ModelConfig& cfg);
// "PAD,BOS,EOS" (each an id or "none"), as keel ckpt export --token-ids takes them; throws
// keel::UsageError naming the text otherwise.
TokenIds parse_token_ids(const std::string& text, std::int64_t vocab_size);

// The config.json of the layout (model_type "zaya"); `dtype`: "float32" or "bfloat16". Throws
// keel::UsageError for a model the layout's config cannot describe (zaya1-alternating:
// sliding-window layers).
nlohmann::json hf_config(const ModelConfig& cfg, Names names, std::string_view dtype, const TokenIds& ids);

// The keel model the config.json `config` describes, for weights under `names`, named `name`.
// Throws keel::UsageError, one line starting with `what` (the file's path) and naming the key,
// for a value keel cannot represent (rope_type "yarn", hidden_act "gelu", attention_bias true,
// num_experts_per_tok 2, ...), keys that contradict each other, and any key that is not known
// to leave the computation alone.
ModelConfig model_of_hf_config(const nlohmann::json& config, Names names, const std::string& name,
                               const std::string& what);

}  // namespace keel::model::released

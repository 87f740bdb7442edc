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

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/released_names.h"

namespace keel::model::released {

// The config.json of the layout (model_type "zaya"); `dtype`: "float32" or "bfloat16". Values
// keel's config does not hold (token ids) are the release's. Throws keel::UsageError for a
// model the layout's config cannot describe (zaya1-alternating: sliding-window layers).
nlohmann::json hf_config(const ModelConfig& cfg, Names names, std::string_view dtype);

// The keel model the config.json `config` describes, for weights under `names`, named `name`.
// Throws keel::UsageError, one line starting with `what` (the file's path) and naming the key,
// for a value keel cannot represent (rope_type "yarn", hidden_act "gelu", attention_bias true,
// num_experts_per_tok 2, ...), keys that contradict each other, and any key that is not known
// to leave the computation alone.
ModelConfig model_of_hf_config(const nlohmann::json& config, Names names, const std::string& name,
                               const std::string& what);

}  // namespace keel::model::released

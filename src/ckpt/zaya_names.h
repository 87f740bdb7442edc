// ZAYA1 weights in and out: keel's checkpoint tensors <-> the parameter names and layouts of
// Zyphra's Hugging Face implementation, so a keel-trained ZAYA1 loads in the ecosystem's tools
// and released ZAYA1 weights start a keel run (`keel ckpt export|import --names ...`,
// docs/checkpoint.md "ZAYA1 weights").
//
// The mapping itself (the two released layouts, one rule per released tensor) is the model
// schema's: model/released_names.h. This file moves the bytes by it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ckpt/safetensors.h"
#include "ckpt/types.h"
#include "model/config.h"
#include "model/released_config.h"
#include "model/released_names.h"

namespace keel::ckpt::zaya {

using model::released::build_name_map;
using model::released::check_coverage;
using model::released::hf_config;
using model::released::KeelTensor;
using model::released::model_of_hf_config;
using model::released::NameMap;
using model::released::Names;
using model::released::parse_names;
using model::released::Piece;
using model::released::Rule;
using model::released::to_string;

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
// with check_export_target (an existing one is replaced only with `overwrite`). config.json names
// `ids` as the tokenizer's special ids.
ZayaStats export_zaya_safetensors(const std::string& src, const std::string& out, const model::ModelConfig& cfg,
                                  Names names, ElemType dtype, int threads, const model::released::TokenIds& ids,
                                  bool overwrite = false);

// The config.json of the release `in` (a directory: the one in it; a .safetensors file: the one
// beside it); "" when there is none.
std::string release_config_path(const std::string& in);

// The model to import the release `in` into: the one its config.json describes
// (model_of_hf_config, named after the release's directory), or `given` (--model, read from
// `given_path`) where there is no config.json. With both, they must agree on every key that
// shapes the computation (model::model_key_values): else one error naming the first key that
// differs; the model is then `given` (its name). Throws keel::UsageError when there is neither.
model::ModelConfig release_model(const std::string& in, Names names, const std::optional<model::ModelConfig>& given,
                                 const std::string& given_path);

// The train config an imported checkpoint records as its state's "config", as keel train's
// checkpoints do: the model's keys inline (data and steps are placeholders), so keel generate,
// keel eval and keel train (init_from) take the model from the checkpoint.
std::string imported_train_config(const model::ModelConfig& cfg);

// Reads released weights and commits a keel checkpoint under the new root `dst`
// (require_new_root) at `step` (nullopt: the keel.step a keel export recorded in the file's
// __metadata__, else 0) holding fp32
// `model/<param>` tensors (and `router/bias.<i>` when the release has the balancing biases).
// `in`: a .safetensors file, or a directory holding model.safetensors.index.json (sharded
// release) or model.safetensors. Accepts F32, BF16 and F16 tensors. Throws keel::Error naming
// the tensor for an unknown released name (with a hint when it belongs to the other layout), a
// missing one, a duplicate, a wrong shape or a non-float dtype. Holds the whole model in fp32
// in memory (twice while the checkpoint is staged). The checkpoint's state records the model
// (imported_train_config) and `model_from`, where its config came from (config.json or --model).
ZayaStats import_zaya_safetensors(const std::string& in, const std::string& dst, const model::ModelConfig& cfg,
                                  Names names, std::optional<std::int64_t> step, int threads,
                                  const std::string& model_from = "");

}  // namespace keel::ckpt::zaya

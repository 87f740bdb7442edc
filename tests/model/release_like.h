// A zaya1-tiny (configs/zaya1-tiny.yaml) as the ZAYA1 release differs from keel's pretraining
// config: 4 layers, every second one sliding (window `window`) with its own RoPE (base 1e4, full
// rotary), RoPE 5e6 on the full layers, an untied head, norm epsilon 1e-6. For the tests of
// config.json export and import (tests/model, tests/ckpt).
#pragma once

#include <string>

#include "model/config.h"

namespace keel::test {

inline model::ModelConfig release_like_tiny(const std::string& name, int window, int max_seq_len) {
  model::ModelConfig m = model::load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/zaya1-tiny.yaml");
  m.name = name;
  m.layers = 4;
  m.layer_sliding = {false, true};
  m.sliding_window = window;
  m.rope_base = 5e6;
  m.sliding_rope_base = 1e4;
  m.sliding_rope_fraction = 1.0;
  m.tied_embeddings = false;
  m.norm_eps = 1e-6;
  m.max_seq_len = max_seq_len;
  model::validate(m);
  return m;
}

}  // namespace keel::test

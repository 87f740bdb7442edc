// The rotary tables of a model's layers (CPU; the GPU twin is blocks/cuda/rope_tables.h).
// Every layer rotates q and k with RoPE (ops/rope.h) at the model's rope_base / rope_fraction,
// except sliding-window layers, which may have their own (sliding_rope_base /
// sliding_rope_fraction: model::layer_rope_base / layer_rope_fraction). One table is built per
// distinct (base, fraction), shared by the layers that use it; a driver hands each layer's
// attention block its own table (blocks::AttnContext::rope).
#pragma once

#include <cstddef>
#include <vector>

#include "model/config.h"
#include "ops/rope.h"

namespace keel::blocks {

struct RopeTables {
  std::vector<ops::rope::Table> tables;  // one per distinct (base, fraction), in order of first use
  std::vector<int> of_layer;             // [layers]: the index of layer l's table
  const ops::rope::Table& layer(int l) const {
    return tables[static_cast<std::size_t>(of_layer[static_cast<std::size_t>(l)])];
  }
  int max_positions() const { return tables.empty() ? 0 : tables.front().max_positions; }
};

// The tables of cfg's layers for positions 0..max_positions-1 (head_dim cfg.head_dim).
RopeTables make_rope_tables(const model::ModelConfig& cfg, int max_positions);

}  // namespace keel::blocks

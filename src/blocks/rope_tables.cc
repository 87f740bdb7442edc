#include "blocks/rope_tables.h"

#include <utility>

namespace keel::blocks {

RopeTables make_rope_tables(const model::ModelConfig& cfg, int max_positions) {
  RopeTables r;
  std::vector<std::pair<double, double>> made;  // (base, fraction) of each table
  for (int l = 0; l < cfg.layers; ++l) {
    const std::pair<double, double> key{model::layer_rope_base(cfg, l), model::layer_rope_fraction(cfg, l)};
    std::size_t i = 0;
    while (i < made.size() && made[i] != key) ++i;
    if (i == made.size()) {
      made.push_back(key);
      r.tables.push_back(ops::rope::make_table(cfg.head_dim, key.second, key.first, max_positions));
    }
    r.of_layer.push_back(static_cast<int>(i));
  }
  return r;
}

}  // namespace keel::blocks

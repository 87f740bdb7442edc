#include "blocks/cuda/rope_tables.h"

#include <cstddef>

namespace keel::blocks::cuda {

DeviceRopeTables::DeviceRopeTables(const RopeTables& host)
    : of_layer_(host.of_layer), max_positions_(host.max_positions()) {
  for (const ops::rope::Table& t : host.tables) tables_.push_back(std::make_unique<ops::cuda::rope::UploadedTable>(t));
}

const ops::cuda::rope::DeviceTable& DeviceRopeTables::layer(int l) const {
  return tables_[static_cast<std::size_t>(of_layer_[static_cast<std::size_t>(l)])]->view();
}

}  // namespace keel::blocks::cuda

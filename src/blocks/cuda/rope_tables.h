// The device copies of a model's rotary tables (CUDA builds only): blocks/rope_tables.h's
// tables uploaded once each, picked by layer for the layer's attention block
// (blocks::cuda::AttnContext::rope).
#pragma once

#include <memory>
#include <vector>

#include "blocks/rope_tables.h"
#include "ops/cuda/rope.h"

namespace keel::blocks::cuda {

class DeviceRopeTables {
 public:
  explicit DeviceRopeTables(const RopeTables& host);  // uploads synchronously (ops/cuda/rope.h)
  const ops::cuda::rope::DeviceTable& layer(int l) const;
  int max_positions() const { return max_positions_; }

 private:
  std::vector<std::unique_ptr<ops::cuda::rope::UploadedTable>> tables_;
  std::vector<int> of_layer_;
  int max_positions_ = 0;
};

}  // namespace keel::blocks::cuda

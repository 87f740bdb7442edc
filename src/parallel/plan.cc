#include "parallel/plan.h"

#include <fmt/format.h>

#include "common/error.h"

namespace keel::parallel {

void check_plan(const model::ModelConfig& model, const mesh::Shape& shape, const std::string& what) {
  for (mesh::Axis a : {mesh::Axis::kTensor, mesh::Axis::kContext, mesh::Axis::kTsp, mesh::Axis::kPipeline})
    if (shape.degree(a) > 1)
      throw UsageError(fmt::format("{}: {} parallelism ({}={}) is not implemented yet (data and expert parallelism are)",
                                   what, mesh::axis_title(a), mesh::axis_name(a), shape.degree(a)));
  if (shape.ep > 1 && (model.experts < 1 || model.experts % shape.ep != 0))
    throw UsageError(fmt::format("{}: model '{}': {} experts do not split over expert-parallel degree {}", what,
                                 model.name, model.experts, shape.ep));
}

CpuPlan::CpuPlan(const model::ModelConfig& cfg, const Mesh& mesh) {
  check_plan(cfg, mesh.shape());
  layers_.assign(static_cast<std::size_t>(cfg.layers), blocks::LayerRunners{});
  for (int l = 0; l < cfg.layers; ++l) {
    if (mesh.expert().size == 1 || !model::is_moe_layer(cfg, l)) continue;
    ep_layers_.push_back(std::make_unique<ExpertParallelMoe>(mesh.expert().comm, cfg.experts));
    layers_[static_cast<std::size_t>(l)].experts = ep_layers_.back().get();
  }
}

}  // namespace keel::parallel

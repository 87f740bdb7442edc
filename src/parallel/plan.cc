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

}  // namespace keel::parallel

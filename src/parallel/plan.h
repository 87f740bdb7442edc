// How a model runs over a mesh: the checks of a model against a mesh shape, in one place, and
// (plan_cuda.h, plan.cc) the runners each block gets: at degree 1 the local ops, otherwise a
// scheme's (docs/architecture.md, "Adding a parallel scheme").
#pragma once

#include <string>

#include "mesh/shape.h"
#include "model/config.h"

namespace keel::parallel {

// Throws keel::UsageError, one line prefixed by `what`, when `model` cannot run on a mesh of
// `shape`: an axis keel train does not implement yet (tp, cp, tsp, pp above 1), or expert
// parallelism that does not divide the experts (or a model without experts). Every backend calls
// it first; the mesh shape itself is checked by mesh::validate (parallel::Mesh).
void check_plan(const model::ModelConfig& model, const mesh::Shape& shape, const std::string& what = "keel train");

}  // namespace keel::parallel

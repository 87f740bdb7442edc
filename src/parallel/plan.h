// How a model runs over a mesh: the checks of a model against a mesh shape, in one place, and
// (plan_cuda.h, plan.cc) the runners each block gets: at degree 1 the local ops, otherwise a
// scheme's (docs/architecture.md, "Adding a parallel scheme").
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "blocks/runners.h"
#include "mesh/shape.h"
#include "model/config.h"
#include "parallel/expert_parallel.h"
#include "parallel/mesh.h"

namespace keel::parallel {

// Throws keel::UsageError, one line prefixed by `what`, when `model` cannot run on a mesh of
// `shape`: an axis keel train does not implement yet (tp, cp, tsp, pp above 1), or expert
// parallelism that does not divide the experts (or a model without experts). Every backend calls
// it first; the mesh shape itself is checked by mesh::validate (parallel::Mesh).
void check_plan(const model::ModelConfig& model, const mesh::Shape& shape, const std::string& what = "keel train");

// The CPU runners of a model under a mesh (blocks/runners.h): one LayerRunners per layer. At
// degree 1 every runner is the local op; expert parallelism gives each MoE layer an
// ExpertParallelMoe over the mesh's expert group. The GPU twin is plan_cuda.h.
class CpuPlan {
 public:
  // Checks the model against the mesh (check_plan).
  CpuPlan(const model::ModelConfig& cfg, const Mesh& mesh);
  const std::vector<blocks::LayerRunners>& layers() const { return layers_; }

 private:
  std::vector<std::unique_ptr<ExpertParallelMoe>> ep_layers_;  // per MoE layer
  std::vector<blocks::LayerRunners> layers_;
};

}  // namespace keel::parallel

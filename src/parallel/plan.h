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
#include "parallel/tensor_parallel.h"

namespace keel::parallel {

// Throws keel::UsageError, one line prefixed by `what`, when `model` cannot run on a mesh of
// `shape`: an axis keel train does not implement yet (cp, tsp, pp above 1), expert parallelism
// that does not divide the experts (or a model without experts), or a tensor degree that does not
// divide the heads, the FFN widths or the vocabulary (nor the kv heads, nor is a multiple of
// them; CCA: must divide them). Every backend calls
// it first; the mesh shape itself is checked by mesh::validate (parallel::Mesh).
void check_plan(const model::ModelConfig& model, const mesh::Shape& shape, const std::string& what = "keel train");

// The CPU runners of a model under a mesh (blocks/runners.h): one LayerRunners per layer. At
// degree 1 every runner is the local op; expert parallelism gives each MoE layer an
// ExpertParallelMoe over the mesh's expert group. The GPU twin is plan_cuda.h.
class CpuPlan {
 public:
  // Checks the model against the mesh (check_plan). tokens: the rows a block reads (the
  // micro-batch's tokens); sequence: sequence parallelism over the tensor group.
  CpuPlan(const model::ModelConfig& cfg, const Mesh& mesh, std::int64_t tokens = 0, bool sequence = false);
  const std::vector<blocks::LayerRunners>& layers() const { return layers_; }
  // The tensor-parallel boundary, null at tensor degree 1.
  TensorParallelLinear* tensor() const { return tp_.get(); }

 private:
  std::unique_ptr<TensorParallelLinear> tp_;
  std::vector<std::unique_ptr<ExpertParallelMoe>> ep_layers_;  // per MoE layer
  std::vector<blocks::LayerRunners> layers_;
};

}  // namespace keel::parallel

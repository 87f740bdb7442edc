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
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/mesh.h"
#include "parallel/tensor_parallel.h"
#include "parallel/tsp.h"

namespace keel::parallel {

// Throws keel::UsageError, one line prefixed by `what`, when `model` cannot run on a mesh of
// `shape`: an axis keel train does not implement yet (pp above 1), tsp beside tp or cp, expert parallelism
// that does not divide the experts (or a model without experts), or a tensor (or tsp) degree that
// does not divide the heads, the FFN widths or the vocabulary (nor the kv heads, nor is a
// multiple of them; CCA: must divide them). Every backend calls
// it first; the mesh shape itself is checked by mesh::validate (parallel::Mesh).
void check_plan(const model::ModelConfig& model, const mesh::Shape& shape, const std::string& what = "keel train");

// The tokens CCA's convolutions read before a token (its context-parallel halo): 1 for a model
// without CCA (the split must still leave every chunk a token).
std::int64_t context_halo(const model::ModelConfig& cfg);

// parallel.context_mode: alltoall splits every layer's heads (and kv heads) of each tensor rank
// over the context ranks: throws keel::UsageError naming the counts that do not divide.
void check_alltoall(const model::ModelConfig& cfg, int tensor, int context);

// The CPU runners of a model under a mesh (blocks/runners.h): one LayerRunners per layer. At
// degree 1 every runner is the local op; context parallelism gives every layer the
// ContextParallel attention core and token group, tensor parallelism the TensorParallelLinear
// boundary, expert parallelism each MoE layer an ExpertParallelMoe over the mesh's expert group.
// TSP (tsp.h) gives every layer the ContextParallel core over the tsp group and the weight
// shards (tsp()), through which the model runs each sub-block once per shard.
// The GPU twin is plan_cuda.h.
class CpuPlan {
 public:
  // Checks the model against the mesh (check_plan, and that seq splits over the context
  // group). batch x seq: the micro-batch (seq: whole sequences); sequence: sequence
  // parallelism over the tensor group; context: how context parallelism's sequence mixers see
  // the rest of the sequence (context_parallel.h).
  CpuPlan(const model::ModelConfig& cfg, const Mesh& mesh, std::int64_t batch = 0, std::int64_t seq = 0,
          bool sequence = false, ContextMode context = ContextMode::kAllGather);
  const std::vector<blocks::LayerRunners>& layers() const { return layers_; }
  // The tensor-parallel boundary, null at tensor degree 1.
  TensorParallelLinear* tensor() const { return tp_.get(); }
  // The context-parallel core (over the context group, or the tsp group under TSP), null when
  // every rank holds whole sequences.
  ContextParallel* context() const { return cp_.get(); }
  // TSP's weight shards, null at tsp degree 1.
  TspShards* tsp() const { return tsp_.get(); }
  // Layer `layer`'s expert runner for weight shard `shard` (TSP; otherwise shard 0): null where
  // the experts run here.
  ops::moe::ExpertRunner* experts(int layer, int shard) const;

 private:
  std::unique_ptr<ContextParallel> cp_;
  std::unique_ptr<TensorParallelLinear> tp_;
  std::unique_ptr<TspShards> tsp_;
  std::vector<std::unique_ptr<ExpertParallelMoe>> ep_layers_;  // [layer * shards + shard]
  std::vector<blocks::LayerRunners> layers_;
};

}  // namespace keel::parallel

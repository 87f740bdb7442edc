// The GPU runners of a model under a mesh (blocks/cuda/runners.h): one LayerRunners per layer.
// At degree 1 every runner is the local op; expert parallelism gives each MoE layer a
// CudaExpertParallelMoe over the mesh's expert group. CUDA builds only.
#pragma once

#include <memory>
#include <vector>

#include "blocks/cuda/runners.h"
#include "model/config.h"
#include "blocks/shape.h"
#include "parallel/context_parallel_cuda.h"
#include "parallel/expert_parallel_cuda.h"
#include "parallel/mesh.h"
#include "parallel/tensor_parallel_cuda.h"
#include "parallel/tsp_cuda.h"

namespace keel::parallel {

class CudaPlan {
 public:
  // Checks the model against the mesh (check_plan, and that seq splits over the context group)
  // and, with expert parallelism, builds the expert group's runners (collective over the expert
  // group, with this rank's GPU set); with context parallelism every block's attention core is
  // one CudaContextParallel over the context group; with tensor parallelism every block's linear
  // runner is one CudaTensorParallelLinear over the tensor group; with TSP every block's
  // attention core is one CudaContextParallel over the tsp group and the model runs each
  // sub-block once per weight shard through tsp() (tsp_cuda.h). batch x seq: the micro-batch
  // (seq: whole sequences); sequence: sequence parallelism.
  CudaPlan(const model::ModelConfig& cfg, Mesh& mesh, std::int64_t batch = 0, std::int64_t seq = 0,
           bool sequence = false);
  const std::vector<blocks::cuda::LayerRunners>& layers() const { return layers_; }
  // GPU memory the runners hold of their own: the expert exchange's buffers (expert_bytes), the
  // sequence-parallel gathers' (tensor_bytes), TSP's shard buffers (tsp_bytes), the
  // context-parallel gathers' (context_bytes) and LASP-2's state gathers (lasp2_bytes).
  std::size_t expert_bytes() const;
  std::size_t tensor_bytes() const { return tp_ ? tp_->device_bytes() : 0; }
  std::size_t tsp_bytes() const { return tsp_ ? tsp_->shard_bytes() : 0; }
  std::size_t context_bytes() const { return cp_ ? cp_->device_bytes() : 0; }
  std::size_t lasp2_bytes() const { return cp_ ? cp_->state_bytes() : 0; }  // LASP-2's state gathers
  // The tensor-parallel boundary, null at tensor degree 1.
  CudaTensorParallelLinear* tensor() const { return tp_.get(); }
  // The context-parallel core, null at context degree 1 (and tsp degree 1).
  CudaContextParallel* context() const { return cp_.get(); }
  // TSP's weight shards, null at tsp degree 1.
  CudaTspShards* tsp() const { return tsp_.get(); }
  // The group whose ranks split the weights, for the optimizer step's sums (partial gradients,
  // the norm): the tensor boundary, or under TSP one over the tsp group (no buffers); null
  // when neither splits them.
  CudaTensorParallelLinear* weight_group() const { return tp_ ? tp_.get() : tsp_sums_.get(); }

 private:
  void reserve_lasp2(const model::ModelConfig& cfg, const blocks::AttnShape& s, std::int64_t batch);

  std::unique_ptr<CudaContextParallel> cp_;
  std::unique_ptr<CudaTensorParallelLinear> tp_;
  std::unique_ptr<CudaTspShards> tsp_;
  std::unique_ptr<CudaTensorParallelLinear> tsp_sums_;
  std::shared_ptr<CudaExpertParallelGroup> ep_group_;
  std::vector<std::unique_ptr<CudaExpertParallelMoe>> ep_layers_;  // per MoE layer (and TSP weight shard)
  std::vector<blocks::cuda::LayerRunners> layers_;
};

}  // namespace keel::parallel

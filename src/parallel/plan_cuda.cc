#include "parallel/plan_cuda.h"

#include "parallel/plan.h"

#include <fmt/format.h>

#include "blocks/shape.h"
#include "common/error.h"

namespace keel::parallel {

CudaPlan::CudaPlan(const model::ModelConfig& cfg, Mesh& mesh, std::int64_t batch, std::int64_t seq, bool sequence) {
  check_plan(cfg, mesh.shape());
  layers_.assign(static_cast<std::size_t>(cfg.layers), blocks::cuda::LayerRunners{});
  const Group& context = mesh.group(GroupKind::kContext);
  const Group& tsp = mesh.group(GroupKind::kTsp);
  std::int64_t tokens = batch * seq;
  if (tsp.size > 1) {
    if (sequence) throw UsageError("parallel.sequence is tensor parallelism's; TSP (parallel.tsp) splits the tokens already");
    check_context_split(seq, tsp.size, context_halo(cfg), "keel train");
    // every shard's attention has this shape's kv width (shard r's heads instead of this rank's)
    const blocks::AttnShape s = blocks::AttnShape::of(cfg, batch, seq / tsp.size, {tsp.size, tsp.rank});
    cp_ = std::make_unique<CudaContextParallel>(mesh.nccl(GroupKind::kTsp), tsp.comm, batch, seq, s.kv_dim());
    for (auto& l : layers_) l.attention = cp_.get();
    tokens /= tsp.size;
    tsp_ = std::make_unique<CudaTspShards>(mesh.nccl_side(GroupKind::kTsp), mesh.nccl(GroupKind::kTsp), tokens,
                                           cfg.hidden);
    tsp_sums_ = std::make_unique<CudaTensorParallelLinear>(mesh.nccl(GroupKind::kTsp), tokens, cfg.hidden, false);
    reserve_lasp2(cfg, s, batch);
  } else if (context.size > 1) {
    check_context_split(seq, context.size, context_halo(cfg), "keel train");
    const int T = mesh.group(GroupKind::kTensor).size;
    const blocks::AttnShape s = blocks::AttnShape::of(cfg, batch, seq / context.size, {T, mesh.coord().tp});
    cp_ = std::make_unique<CudaContextParallel>(mesh.nccl(GroupKind::kContext), context.comm, batch, seq, s.kv_dim());
    for (auto& l : layers_) l.attention = cp_.get();
    tokens /= context.size;
    reserve_lasp2(cfg, s, batch);
  }
  if (mesh.group(GroupKind::kTensor).size > 1) {
    tp_ = std::make_unique<CudaTensorParallelLinear>(mesh.nccl(GroupKind::kTensor), tokens, cfg.hidden, sequence);
    for (auto& l : layers_) l.attn_linear = l.mlp_linear = tp_.get();
  }
  if (mesh.expert().size > 1)
    ep_group_ = std::make_shared<CudaExpertParallelGroup>(mesh.expert().comm, mesh.nccl(GroupKind::kExpert), cfg.experts);
  // one runner per MoE layer, or under TSP per layer and weight shard (each pass keeps its rows)
  for (int l = 0; l < cfg.layers; ++l) {
    if (!ep_group_ || !model::is_moe_layer(cfg, l)) continue;
    blocks::cuda::LayerRunners& r = layers_[static_cast<std::size_t>(l)];
    for (int shard = 0; shard < tsp.size; ++shard) {
      ep_layers_.push_back(std::make_unique<CudaExpertParallelMoe>(ep_group_));
      if (tsp.size > 1) r.shard_experts.push_back(ep_layers_.back().get());
    }
    r.experts = ep_layers_[ep_layers_.size() - static_cast<std::size_t>(tsp.size)].get();
  }
}

// LASP-2's state buffers (lasp2_cuda.cc) at their size from the start, so the start-up memory
// line holds them: two runs per sequence, this rank's kv heads, d x d fp32 each.
void CudaPlan::reserve_lasp2(const model::ModelConfig& cfg, const blocks::AttnShape& s, std::int64_t batch) {
  if (model::attention_layer_count(cfg, model::AttentionKind::kLinear) == 0) return;
  cp_->reserve_states(2 * batch * s.kv_heads * std::int64_t(s.head_dim) * s.head_dim);
}

std::size_t CudaPlan::expert_bytes() const {
  std::size_t b = ep_group_ ? ep_group_->device_bytes() : 0;
  for (const auto& l : ep_layers_) b += l->device_bytes();
  return b;
}

}  // namespace keel::parallel

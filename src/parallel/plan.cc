#include "parallel/plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"

namespace keel::parallel {

void check_plan(const model::ModelConfig& model, const mesh::Shape& shape, const std::string& what) {
  if (shape.pp > 1)
    throw UsageError(fmt::format(
        "{}: pipeline parallelism (pp={}) is not implemented yet (data, context, tensor, tsp and expert parallelism are)",
        what, shape.pp));
  if (shape.tsp > 1 && (shape.tp > 1 || shape.cp > 1))
    throw UsageError(fmt::format("{}: parallel.tsp ({}) with parallel.{} ({}): TSP already splits the weights and the "
                                 "tokens over its axis; combine it with data and expert parallelism only",
                                 what, shape.tsp, shape.tp > 1 ? "tensor" : "context", shape.tp > 1 ? shape.tp : shape.cp));
  if (shape.ep > 1 && (model.experts < 1 || model.experts % shape.ep != 0))
    throw UsageError(fmt::format("{}: model '{}': {} experts do not split over expert-parallel degree {}", what,
                                 model.name, model.experts, shape.ep));
  const int T = shape.tp * shape.tsp;  // TSP slices the weights as tensor parallelism does
  if (T == 1) return;
  const auto refuse = [&](const std::string& why) {
    throw UsageError(fmt::format("{}: model '{}' does not split over {} degree {} (parallel.{}): {}", what, model.name,
                                 shape.tsp > 1 ? "tsp" : "tensor-parallel", T, shape.tsp > 1 ? "tsp" : "tensor", why));
  };
  if (model.heads % T != 0) refuse(fmt::format("{} attention heads do not divide by {}", model.heads, T));
  if (model.vocab_size % T != 0)
    refuse(fmt::format("the vocabulary of {} does not divide by {} (pad vocab_size)", model.vocab_size, T));
  bool cca = false;
  for (int l = 0; l < model.layers; ++l) {
    cca |= model::layer_attention_kind(model, l) == model::AttentionKind::kCca;
    if (model::is_moe_layer(model, l) ? model.expert_hidden % T != 0 : model.ffn_hidden % T != 0)
      refuse(fmt::format("layer {}'s {} width {} does not divide by {}", l,
                         model::is_moe_layer(model, l) ? "expert_hidden" : "ffn_hidden",
                         model::is_moe_layer(model, l) ? model.expert_hidden : model.ffn_hidden, T));
  }
  if (model.kv_heads % T != 0 && T % model.kv_heads != 0)
    refuse(fmt::format("{} kv heads: the degree must divide them or be a multiple of them (to replicate them)",
                       model.kv_heads));
  if (cca && model.kv_heads % T != 0 && shape.tsp > 1)
    refuse(fmt::format("TSP over more ranks than CCA's {} kv heads is not supported (its shards would repeat the "
                       "whole CCA projections per shard); parallel.tensor replicates them",
                       model.kv_heads));
}

std::int64_t context_halo(const model::ModelConfig& cfg) {
  for (int l = 0; l < cfg.layers; ++l)
    if (model::layer_attention_kind(cfg, l) == model::AttentionKind::kCca)
      return std::max<std::int64_t>(1, (cfg.cca_conv_width - 1) + (cfg.cca_group_conv_width - 1));
  return 1;
}

// parallel.context_mode: alltoall splits every layer's heads (and kv heads) of this tensor rank
// over the context group: one line naming the first that does not divide.
void check_alltoall(const model::ModelConfig& cfg, int tensor, int context) {
  // replicated past the kv heads: the rank's query heads read one (blocks::AttnShape::kv_head0)
  const int kv = cfg.kv_heads >= tensor ? cfg.kv_heads / tensor : 1;
  const int q = cfg.heads / tensor;
  if (q % context != 0 || kv % context != 0)
    throw UsageError(fmt::format("parallel.context_mode: alltoall splits each layer's heads over the {} context ranks: "
                                 "model '{}' has {} query and {} kv heads per tensor rank; both must divide by {} (or "
                                 "use parallel.context_mode: allgather)",
                                 context, cfg.name, q, kv, context));
}

CpuPlan::CpuPlan(const model::ModelConfig& cfg, const Mesh& mesh, std::int64_t batch, std::int64_t seq, bool sequence,
                 ContextMode mode) {
  check_plan(cfg, mesh.shape());
  layers_.assign(static_cast<std::size_t>(cfg.layers), blocks::LayerRunners{});
  // The tokens split over the context group, or under TSP over the tsp group (which then also
  // slices the weights: tsp_).
  const Group& tsp = mesh.group(GroupKind::kTsp);
  const Group& context = tsp.size > 1 ? tsp : mesh.group(GroupKind::kContext);
  std::int64_t tokens = batch * seq;
  if (tsp.size > 1) {
    if (sequence) throw UsageError("parallel.sequence is tensor parallelism's; TSP (parallel.tsp) splits the tokens already");
    if (mode == ContextMode::kAllToAll)
      throw UsageError(fmt::format("parallel.context_mode: {} is context parallelism's; TSP gathers the k and v of "
                                   "each head shard (allgather) or passes them around the group (ring)",
                                   context_mode_name(mode)));
    tsp_ = std::make_unique<TspShards>(tsp.comm);
  }
  if (context.size > 1) {
    check_context_split(seq, context.size, context_halo(cfg), "keel train");
    if (mode == ContextMode::kAllToAll) check_alltoall(cfg, mesh.group(GroupKind::kTensor).size, context.size);
    cp_ = std::make_unique<ContextParallel>(context.comm, seq, mode);
    for (auto& l : layers_) {
      l.attention = cp_.get();
      l.tokens = cp_.get();
    }
    tokens /= context.size;
  }
  if (mesh.group(GroupKind::kTensor).size > 1) {
    tp_ = std::make_unique<TensorParallelLinear>(mesh.group(GroupKind::kTensor).comm, tokens, cfg.hidden, sequence);
    for (auto& l : layers_) l.attn_linear = l.mlp_linear = tp_.get();
  } else if (sequence) {
    throw UsageError("parallel.sequence needs parallel.tensor above 1 (it splits the tokens over the tensor group)");
  }
  // Expert parallelism: a runner per MoE layer (under TSP per layer and weight shard: each keeps
  // its forward for its backward).
  const int shards = tsp.size;
  ep_layers_.clear();
  ep_layers_.resize(static_cast<std::size_t>(cfg.layers) * shards);
  for (int l = 0; l < cfg.layers; ++l) {
    if (mesh.expert().size == 1 || !model::is_moe_layer(cfg, l)) continue;
    for (int r = 0; r < shards; ++r)
      ep_layers_[static_cast<std::size_t>(l) * shards + r] =
          std::make_unique<ExpertParallelMoe>(mesh.expert().comm, cfg.experts);
    layers_[static_cast<std::size_t>(l)].experts = ep_layers_[static_cast<std::size_t>(l) * shards].get();
  }
}

ops::moe::ExpertRunner* CpuPlan::experts(int layer, int shard) const {
  const std::size_t shards = tsp_ ? static_cast<std::size_t>(tsp_->size()) : 1;
  return ep_layers_.at(static_cast<std::size_t>(layer) * shards + static_cast<std::size_t>(shard)).get();
}

}  // namespace keel::parallel

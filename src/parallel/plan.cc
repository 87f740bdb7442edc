#include "parallel/plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"

namespace keel::parallel {

void check_plan(const model::ModelConfig& model, const mesh::Shape& shape, const std::string& what) {
  for (mesh::Axis a : {mesh::Axis::kTsp, mesh::Axis::kPipeline})
    if (shape.degree(a) > 1)
      throw UsageError(fmt::format(
          "{}: {} parallelism ({}={}) is not implemented yet (data, context, tensor and expert parallelism are)", what,
          mesh::axis_title(a), mesh::axis_name(a), shape.degree(a)));
  if (shape.ep > 1 && (model.experts < 1 || model.experts % shape.ep != 0))
    throw UsageError(fmt::format("{}: model '{}': {} experts do not split over expert-parallel degree {}", what,
                                 model.name, model.experts, shape.ep));
  const int T = shape.tp;
  if (T == 1) return;
  const auto refuse = [&](const std::string& why) {
    throw UsageError(fmt::format("{}: model '{}' does not split over tensor-parallel degree {} (parallel.tensor): {}",
                                 what, model.name, T, why));
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
  if (cca && model.kv_heads % T != 0)
    refuse(fmt::format("CCA needs the degree to divide its {} kv heads: its k mixing term averages the query heads "
                       "of a kv group, which would then span ranks",
                       model.kv_heads));
}

std::int64_t context_halo(const model::ModelConfig& cfg) {
  for (int l = 0; l < cfg.layers; ++l)
    if (model::layer_attention_kind(cfg, l) == model::AttentionKind::kCca)
      return std::max<std::int64_t>(1, (cfg.cca_conv_width - 1) + (cfg.cca_group_conv_width - 1));
  return 1;
}

CpuPlan::CpuPlan(const model::ModelConfig& cfg, const Mesh& mesh, std::int64_t batch, std::int64_t seq, bool sequence,
                 bool ring) {
  check_plan(cfg, mesh.shape());
  layers_.assign(static_cast<std::size_t>(cfg.layers), blocks::LayerRunners{});
  const Group& context = mesh.group(GroupKind::kContext);
  std::int64_t tokens = batch * seq;
  if (context.size > 1) {
    check_context_split(seq, context.size, context_halo(cfg), "keel train");
    cp_ = std::make_unique<ContextParallel>(context.comm, seq, ring);
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
  for (int l = 0; l < cfg.layers; ++l) {
    if (mesh.expert().size == 1 || !model::is_moe_layer(cfg, l)) continue;
    ep_layers_.push_back(std::make_unique<ExpertParallelMoe>(mesh.expert().comm, cfg.experts));
    layers_[static_cast<std::size_t>(l)].experts = ep_layers_.back().get();
  }
}

}  // namespace keel::parallel

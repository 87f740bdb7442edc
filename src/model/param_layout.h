// The parameter schema of keel's decoder-only MoE transformer: every parameter's name, global
// shape and placement over the mesh (mesh/placement.h), how one rank lays its share out in one
// flat fp32 buffer, and how it is initialized. The one place these are decided: the CPU and
// GPU trainers, `keel generate`, checkpoints (keel train's tensors, the ZAYA1 name map) and
// `keel size` all take them from here.
//
// Names (fixed: checkpoints rely on them), per layer l, prefix "layers.<l>.":
//   res_scale.attn.{h_scale,h_bias[,r_scale,r_bias]}  residual scaling (ZAYA1; layer 0 has no r pair)
//   attn_norm.weight
//   attn.{wq,wk,wv,wo}                                 mha / gqa, or
//   attn.cca.{w_qk,w_v,conv0.weight,conv0.bias,conv1.weight,conv1.bias,temp,wo}   CCA
//   res_scale.mlp.{h_scale,h_bias,r_scale,r_bias}      residual scaling
//   mlp_norm.weight
//   mlp.{w_gate,w_up,w_down}                           dense layers, or
//   moe.router                                         linear router [E, D], or ZAYA1's MLP router
//   moe.router.{down.weight,down.bias,eda_scale,norm.weight,mlp1.*,mlp2.*,out.weight}
//   moe.{w_gate,w_up,w_down}                           experts [E, F, D], [E, F, D], [E, D, F]
// and embed.weight first, final_res_scale.*, final_norm.weight and lm_head.weight (untied) last.
//
// Placements: the expert stacks split dimension 0 (the experts) over the expert axis. Over the
// tensor axis (Megatron): the embedding and the LM head by vocabulary rows; q, k, v (CCA: the
// q and k heads of the fused tensors, parts {Q, KV}, the value heads, the temperatures), the
// MLP's and experts' gate and up column-parallel; the attention output and the down projections
// row-parallel (their input dimension). Norms, residual scales and routers are replicated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mesh/shape.h"
#include "model/config.h"
#include "optim/param_groups.h"

namespace keel::model {

// Every parameter of the whole model in model order, with its global shape (also `shape`) and
// placement. Throws keel::UsageError for a dense layer without ffn_hidden.
std::vector<optim::ParamSpec> param_specs(const ModelConfig& cfg);

// The mesh the weights lie over. TSP (parallel/tsp.h) slices every matrix as tensor parallelism
// does, over its own axis, so the tsp degree folds into the tensor degree (tp * tsp, the tsp
// coordinate outer): a TSP rank holds a TP rank's blocks, and its checkpoints resume as TP, DP or
// TSP of another degree. param_layout and init_parameters take the run's mesh and fold it.
mesh::Shape weight_shape(const mesh::Shape& s);
mesh::Coord weight_coord(const mesh::Shape& s, const mesh::Coord& at);

// The flat buffer one rank holds under `mesh` (only the degrees of axes that split parameters
// matter): each parameter's block at this rank (placement.local_shape), in model order, except
// that parameters split over the expert axis come after every other one when ep > 1 (their
// gradients reduce over another group: docs/parallel.md). Optimizer groups are AdamW's
// (embeddings, convs, vectors without weight decay, matrices; train/param_rules.h regroups for
// Muon with the same offsets). Throws keel::UsageError when a split does not divide its
// dimension (experts over ep).
optim::ParamLayout param_layout(const ModelConfig& cfg, const mesh::Shape& mesh = {});
// Whether the tensor (and tsp) ranks of `mesh` outnumber the kv heads, so that every tensor rank holds the
// whole k and v projections (mha / gqa) instead of a slice.
bool kv_replicated(const ModelConfig& cfg, const mesh::Shape& mesh);
// The layout of one expert-parallel rank: param_layout with mesh ep = expert_parallel.
optim::ParamLayout param_layout(const ModelConfig& cfg, int expert_parallel);

// The whole model's parameter count from any rank's layout (its blocks times their splits).
std::int64_t global_param_count(const optim::ParamLayout& layout);

// Where a parameter sits in a layer's forward: the unit the overlapped ZeRO-1 step
// (parallel/zero1_buckets.h) reduces and broadcasts together. In forward order:
//   0            what precedes the first layer (the embedding)
//   1 + 2 l      layer l's attention part (its residual scale, norm and attention)
//   2 + 2 l      the rest of layer l (MLP part)
//   2 layers + 1 what follows the layers (final residual scale, final norm, untied head)
int param_stage(const std::string& name, int layers);
inline int stage_count(int layers) { return 2 * layers + 2; }

// A rank's block of a parameter as pieces of the whole tensor. A block is the local tensor of
// shape p.shape (placement.local_shape); its rows (dimension 0) come in pieces, each a
// rectangular box of the whole tensor: global indices [offset[d], offset[d] + extent[d]) per
// dimension, held from local row `local_row` on (every other dimension from local index 0,
// extent[d] = p.shape[d] for d > 0). One piece for a plain placement (whatever dimensions it
// splits: a row-parallel [D, Q] block is rows [0, D) x columns [t Q/tp, (t+1) Q/tp)); one per
// part for a placement with parts (CCA's [q; k]: the rank's q rows, then its k rows), adjacent
// pieces merged (so one when dimension 0 is not split).
struct BlockPiece {
  std::vector<std::int64_t> offset, extent;  // per dimension, in the whole tensor
  std::int64_t local_row = 0;                // where the piece starts along the block's dimension 0
};
// The pieces of the block of parameter p (a ParamInfo of param_layout(cfg, mesh), whose
// placement is the effective one, e.g. kv_replicated) a rank at coordinate `at` of `mesh` holds,
// in local row order; they cover the block exactly. keel::Error when the placement does not
// split p.global_shape evenly into p.shape (a ParamInfo of another mesh).
std::vector<BlockPiece> block_pieces(const optim::ParamInfo& p, const mesh::Shape& mesh, const mesh::Coord& at);

// Where a rank's block of parameter p starts in the whole tensor (the flat row-major index of
// its element 0) when the block is one contiguous run of it (only leading dimensions split, no
// parts: the expert stacks over ep alone); keel::Error otherwise (use block_pieces).
std::int64_t block_start(const optim::ParamInfo& p, const mesh::Shape& mesh, const mesh::Coord& at);

// normal(0, init_std) for every tensor of >= 2 dims, convs included (output projections `*.wo`,
// `*w_down` x 1/sqrt(2 layers)); 1-D: 0 for names ending in "bias", else 1 (norms, residual
// scales, EDA scale, CCA temperatures). The same values on every platform for a seed, drawn as
// if for the whole model (param_layout(cfg)): a rank's block of a split parameter (at coordinate
// `at` of `mesh`) gets exactly the values the same elements have in the whole model.
// router_init_gain > 0: the MLP router's r x r layers and output layer (moe.router.mlp<i>,
// moe.router.out) are normal(0, router_init_gain / sqrt(fan_in)) instead (the same draws scaled).
void init_parameters(const ModelConfig& cfg, const optim::ParamLayout& layout, double init_std, std::uint64_t seed,
                     float* params, const mesh::Shape& mesh = {}, const mesh::Coord& at = {},
                     double router_init_gain = 0);

// The router selection biases a fresh model starts with, one [classes] per MoE layer: 0, and -1
// for the skip class (ZAYA1: it starts disfavoured).
std::vector<std::vector<float>> initial_router_biases(const ModelConfig& cfg);

}  // namespace keel::model

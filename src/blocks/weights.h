// The parameters of a model by role: views into one flat buffer laid out by model::param_layout
// (the parameters, or the gradients at the same offsets), one LayerWeights per layer. The blocks
// (attention.h, mlp.h, zaya_moe.h) read their weights through it, whether training
// (train/model.h) or decoding (generate/generate.h) drives them. The CUDA blocks have their own
// device views (cuda/weights_cuda.h) built from the same layout.
#pragma once

#include <string>
#include <vector>

#include "blocks/shape.h"
#include "model/config.h"
#include "ops/cca.h"
#include "ops/moe.h"
#include "ops/zaya_router.h"
#include "optim/param_groups.h"
#include "tensor/tensor.h"

namespace keel::blocks {

// The per-channel vectors of one residual-scaling stage (ops::residual_scale), [D] each:
// r_next = (r + r_bias) * r_scale + (h + h_bias) * h_scale. The first stage of the model has
// only the h pair (it scales the embedding, which becomes the residual stream).
struct ResScale {
  Tensor h_scale, h_bias, r_scale, r_bias;
};

struct LayerWeights {
  Tensor attn_norm, wq, wk, wv, wo, mlp_norm;  // wq..wo: mha/gqa layers
  ops::cca::Params cca;                        // CCA layers
  bool moe = false;
  Tensor w_gate, w_up, w_down;       // dense [F, D], [F, D], [D, F]
  Tensor router;                     // linear router [E, D]
  ops::zaya_router::Params zrouter;  // MLP router (router_hidden > 0)
  ops::moe::Weights experts;         // [E, F, D], [E, F, D], [E, D, F] (this rank's E / ep)
  ResScale attn_scale, mlp_scale;    // residual scaling before each stage (residual_scaling)
};

struct WeightViews {
  std::vector<LayerWeights> layers;
  Tensor embed, final_norm, lm_head;  // lm_head views embed with tied embeddings
  ResScale final_scale;               // residual scaling before the final norm
};

// What a parameter is for, from its name (model/param_layout.h lists the names): the one
// name-to-role map, which the host views below and the device views (cuda/weights_cuda.h) both
// use. layer is -1 for the model-level parameters.
enum class Slot {
  kEmbed, kFinalNorm, kLmHead, kFinalHScale, kFinalHBias, kFinalRScale, kFinalRBias,
  kAttnHScale, kAttnHBias, kAttnRScale, kAttnRBias, kAttnNorm, kWq, kWk, kWv, kWo,
  kCcaWqk, kCcaWv, kCcaConv0W, kCcaConv0B, kCcaConv1W, kCcaConv1B, kCcaTemp, kCcaWo,
  kMlpHScale, kMlpHBias, kMlpRScale, kMlpRBias, kMlpNorm, kGate, kUp, kDown,
  kRouter, kZrDownW, kZrDownB, kZrEda, kZrNorm, kZrW1, kZrB1, kZrW2, kZrB2, kZrOut,
  kExpertGate, kExpertUp, kExpertDown,
};
struct ParamRole {
  int layer = -1;
  Slot slot = Slot::kEmbed;
};
// Throws keel::Error ("model: unmapped parameter 'x'") for a name the schema does not have.
ParamRole role_of(const std::string& name);
// True for the parameters the GPU blocks read only through their bf16 copy: the GEMM operands
// (projections, MLPs and experts, the router matrices, the LM head) and the embedding table
// (looked up in bf16). The rest (norms, biases, scales, conv weights, temperatures) is read in
// fp32 (blocks/cuda/weights.h).
bool bf16_only(Slot s);

// The tensor of parameter `p` in a flat buffer laid out by its layout (base + p.offset, p.shape).
Tensor param_view(float* base, const optim::ParamInfo& p);

// The view of a layer's parameter `s` in L (null for the model-level slots): map_weights fills
// it, and TSP (parallel/tsp.h) points it at another rank's shard.
Tensor* layer_slot(LayerWeights& L, Slot s);

// Throws keel::Error naming a parameter of the layout it has no role for.
WeightViews map_weights(const model::ModelConfig& cfg, const optim::ParamLayout& layout, float* base);

// The CCA layer shape of a model (ops::cca::Config from its heads, head_dim and conv widths) on
// tensor rank tp.rank of tp.degree: its share of the heads, or with more ranks than kv heads
// every head with its own query heads attended (Config::attend_q0 / attend_q).
ops::cca::Config cca_config(const model::ModelConfig& cfg, TensorSplit tp = {});

}  // namespace keel::blocks

// The parameters of a model by role on the GPU: device pointers into flat buffers laid out by
// model::param_layout, one LayerWeights (and LayerGrads) per layer, built from the one
// name-to-role map of blocks/weights.h. The GEMM operands (projections, the embedding and LM
// head, dense and expert MLPs, the router matrices) are read in bf16; everything else (norms,
// biases, residual scales, CCA's conv weights and temperatures, the EDA scale) in fp32. The
// training model (train/cuda_model_cuda.h) points them at its fp32 masters and their bf16 copy;
// the decoder (generate/cuda_decoder_cuda.cc) at its uploaded copies. CUDA builds only.
#pragma once

#include <functional>
#include <vector>

#include "model/config.h"
#include "ops/cuda/cca.h"
#include "ops/cuda/common.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/zaya_router.h"
#include "optim/param_groups.h"

namespace keel::blocks::cuda {

using ops::cuda::bf16;

// One residual-scaling stage's vectors (blocks::ResScale), fp32 [D] each; layer 0's attention
// stage has no r pair.
struct ResScale {
  const float *h_scale = nullptr, *h_bias = nullptr, *r_scale = nullptr, *r_bias = nullptr;
};
struct ResScaleGrads {
  float *h_scale = nullptr, *h_bias = nullptr, *r_scale = nullptr, *r_bias = nullptr;
};

struct LayerWeights {
  bool cca = false;     // CCA attention (else mha/gqa, or linear)
  bool linear = false;  // linear attention (ops/cuda/linear_attention.h; wq, wk, wv, wo as mha/gqa)
  int moe = -1;      // MoE stage index, -1 for a dense layer
  const float *attn_norm = nullptr, *mlp_norm = nullptr;
  const bf16 *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;  // mha/gqa
  ops::cuda::cca::Weights cca_w;                                           // CCA
  const bf16 *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;       // dense
  const bf16* router = nullptr;                                            // linear router [E, D]
  ops::cuda::zaya_router::Weights zrouter;                                 // MLP router (gamma null on stage 0)
  ops::cuda::moe::Weights experts;                                         // this rank's experts
  ResScale attn_scale, mlp_scale;
};

struct LayerGrads {  // fp32, at the parameters' offsets in the gradient buffer
  float *attn_norm = nullptr, *mlp_norm = nullptr;
  float *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  ops::cuda::cca::Grads cca;
  float *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr, *router = nullptr;
  ops::cuda::zaya_router::Grads zrouter;
  ops::cuda::moe::Grads experts;  // `overwrite` is set per backward (the step's first writes them)
  ResScaleGrads attn_scale, mlp_scale;
};

struct ModelWeights {
  std::vector<LayerWeights> layers;
  const bf16 *embed = nullptr, *lm_head = nullptr;  // lm_head is the embedding with tied embeddings
  const float* final_norm = nullptr;
  ResScale final_scale;
};

struct ModelGrads {
  std::vector<LayerGrads> layers;
  float *embed = nullptr, *lm_head = nullptr, *final_norm = nullptr;
  ResScaleGrads final_scale;
};

// Where a parameter is read from: its fp32 copy (asked only for the fp32 roles above) and its
// bf16 copy (only for the GEMM roles).
using F32At = std::function<const float*(const optim::ParamInfo&)>;
using Bf16At = std::function<const bf16*(const optim::ParamInfo&)>;
ModelWeights device_weights(const model::ModelConfig& cfg, const optim::ParamLayout& layout, const F32At& f32,
                            const Bf16At& b16);
// The gradients of every parameter at its offset in `grads` (the layout's flat buffer), or
// wherever `at` puts each (TSP's shard buffers: parallel/tsp_cuda.h).
ModelGrads device_grads(const model::ModelConfig& cfg, const optim::ParamLayout& layout, float* grads);
using GradAt = std::function<float*(const optim::ParamInfo&)>;
ModelGrads device_grads(const model::ModelConfig& cfg, const optim::ParamLayout& layout, const GradAt& at);

}  // namespace keel::blocks::cuda

// The MLP block on the GPU, written once for training (train/cuda_model_cuda.h) and decoding
// (generate/cuda_decoder_cuda.cc): a dense SwiGLU MLP, routed SwiGLU experts behind a linear
// top-k router (ops/cuda/router.h, ops/cuda/moe.h), or ZAYA1's MoE stage (zaya_moe.h: the MLP
// router with EDA and the skip class). The CPU twin is blocks/mlp.h.
//
// Dtypes: the input x (the stage's RMSNorm output) bf16 [N, D]; the output fp32 [N, D]: with
// `residual`, y = residual + mlp(x) (the plain pre-norm layer's skip connection; y may be the
// residual itself), else y = mlp(x). Backward: dy fp32 [N, D] in, dx fp32 [N, D] OVERWRITTEN
// (the gradient of x), parameter gradients ACCUMULATED, or written for the expert stacks when
// grads.experts.overwrite is set (the step's first micro-batch). The runners come from the plan
// (runners.h): the dense MLP's tensor-parallel boundary (`linear`), and where a routed layer's
// experts run (`experts`; null runs them all on this GPU). At degree 1 they are the local ops.
//
// Host syncs: a routed layer's forward synchronizes once (moe::make_plan: the expert GEMMs are
// sized on the host), ZAYA1's stage once as well; dense layers and every backward never do.
#pragma once

#include <cstdint>

#include "blocks/cuda/runners.h"
#include "blocks/cuda/weights.h"
#include "blocks/cuda/zaya_moe.h"
#include "blocks/shape.h"
#include "device/device_arena.h"
#include "model/config.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/router.h"

namespace keel::blocks::cuda {

using blocks::MlpShape;  // blocks/shape.h, shared with the CPU block

// What a layer's forward keeps for its backward (one set per layer, or one shared set with full
// recompute; the decoder carves one set as its forward scratch). `dense` / `routed` / `zaya`
// say which parts to carve.
struct MlpSaved {
  bf16 *g = nullptr, *u = nullptr, *a = nullptr;  // dense [N, F]
  float *rlogits = nullptr, *probs = nullptr, *rlse = nullptr, *gates = nullptr, *losses = nullptr;  // routed
  std::int32_t *idx = nullptr, *counts = nullptr, *plan_ws = nullptr;
  ops::cuda::moe::Plan plan;  // routed: the dispatch plan of the last forward
  ops::cuda::moe::Saved experts;
  zaya::Acts zmoe;  // ZAYA1 stage (its experts' Saved is `experts`)
};
struct MlpParts {
  bool dense = false, routed = false;
  bool expert_rows = true;  // false with expert parallelism: the experts' rows live at their rank
  // false: a pass that takes another pass's routing (mlp_forward's `routing`: TSP's passes over
  // the other ranks' weight shards): no router state, dispatch indices or plan workspace of its
  // own (forward points them at the routing pass's).
  bool routing = true;
};
void carve(DeviceCarver& c, const MlpShape& s, const MlpParts& parts, MlpSaved& a);

// Scratch shared by every layer (contents ignored between calls). For backward only where noted.
struct MlpScratch {
  float* moe_out = nullptr;  // [N, D] the MLP output before the residual add (routed layers, or a split dense output)
  bf16 *dy = nullptr;        // [N, D] backward: dy in bf16 (dense)
  bf16 *dx = nullptr;        // [N, D] backward: the experts' dx in bf16 (routed)
  bf16 *dg = nullptr, *du = nullptr, *da = nullptr;  // backward, dense [N, F]
  float *dgates = nullptr, *dlogits = nullptr;       // backward, routed
  bf16* dlogits_bf = nullptr;
  void* moe = nullptr;  // backward: moe::backward_scratch_bytes (local experts)
  zaya::Scratch zs;     // ZAYA1 stage, forward and backward
};
struct MlpScratchParts {
  bool dense = false, routed = false, backward = false;
  bool residual_out = false;  // forward adds into a residual (plain layers)
  bool dense_split = false;   // the dense output is not whole (LinearRunner::output_is_whole)
  bool expert_rows = true;    // as MlpParts
};
void carve(DeviceCarver& c, const MlpShape& s, const MlpScratchParts& parts, MlpScratch& sc);

// The ZAYA1 stage's EDA chain: this stage writes its state, reads the previous stage's.
struct EdaIo {
  float* state = nullptr;       // this stage's [N, R] (kept across recompute)
  const float* prev = nullptr;  // the previous MoE stage's, null on the first
};

// x bf16 [N, D] -> y fp32 [N, D] (see the top). bias: this layer's router selection bias
// (device, [classes]). routing: null, or a pass over the same tokens that routed them (TSP: a
// layer's later weight shards): this pass takes its routing (a's router pointers point at
// routing's) and runs no router (and no host sync).
void mlp_forward(ops::cuda::GemmRunner& gemm, const MlpShape& s, const LayerWeights& w, const float* bias,
                 const bf16* x, const EdaIo& eda, const float* residual, float* y, MlpSaved& a, const MlpScratch& sc,
                 LinearRunner& linear, ops::cuda::moe::ExpertRunner* experts, cudaStream_t stream,
                 const MlpSaved* routing = nullptr);

// The routed layer's expert loads of the last forward: slots per class (ZAYA1: experts, then
// the skip class).
void mlp_loads(const MlpShape& s, const MlpSaved& a, std::int32_t* counts);
// The routed layer's device router losses (ops::cuda::router's aux, z, P_e): the MLP router's
// or the linear one's.
inline const float* router_losses(const MlpSaved& a) { return a.zmoe.router.losses ? a.zmoe.router.losses : a.losses; }

// dy fp32 [N, D] -> dx fp32 [N, D] (overwritten). ZAYA1: dstate_next is dL/d this stage's state
// from the next stage (null on the last), dprev receives dL/d the previous stage's state (null on
// the first). aux_weight, z_weight: the router's loss weights times the loss scale (the MLP
// router takes the aux weight only).
struct EdaGrads {
  const float* dstate_next = nullptr;
  float* dprev = nullptr;
};
// Passes that share one routing (mlp_forward's `routing`) share its backward too: each adds its
// dL/d gates into `dgates` ([N top_k] fp32; the first pass writes it), and only the last runs the
// router's backward, on their sum (its losses' gradients, its share of dx, its EDA gradient).
struct SharedRouting {
  bool first = true, last = true;
  float* dgates = nullptr;
};
void mlp_backward(ops::cuda::GemmRunner& gemm, const MlpShape& s, const LayerWeights& w, const LayerGrads& g,
                  const bf16* x, const EdaIo& eda, const EdaGrads& deda, MlpSaved& a, const MlpScratch& sc,
                  const float* dy, float* dx, float aux_weight, float z_weight, LinearRunner& linear,
                  ops::cuda::moe::ExpertRunner* experts, cudaStream_t stream, const SharedRouting* shared = nullptr);

}  // namespace keel::blocks::cuda

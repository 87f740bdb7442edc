// The MLP block on the CPU (fp32 reference), written once for training (train/model.h) and
// decoding (generate/generate.h): a dense SwiGLU MLP, routed SwiGLU experts behind a linear top-k
// router (ops/router.h, ops/moe.h), or ZAYA1's MoE stage (zaya_moe.h: the MLP router with EDA
// and the skip class). The GPU twin is blocks/cuda/mlp.h.
//
// x (the stage's RMSNorm output) [N, D] -> y [N, D] OVERWRITTEN. Backward: dy [N, D] -> dx [N, D]
// OVERWRITTEN, parameter gradients ACCUMULATED. The runners come from the plan (runners.h): the
// dense MLP's tensor-parallel boundary (`linear`), and where a routed layer's experts run
// (`experts`; null runs them all here). At degree 1 they are the local ops.
#pragma once

#include <cstdint>
#include <string>

#include "blocks/runners.h"
#include "blocks/shape.h"
#include "blocks/weights.h"
#include "blocks/zaya_moe.h"
#include "model/config.h"
#include "ops/moe.h"
#include "tensor/arena.h"

namespace keel::blocks {

// MlpShape: blocks/shape.h.

// What a layer's forward keeps for its backward (a decoder carves one set as its scratch).
struct MlpSaved {
  Tensor g, u, a;                     // dense [N, F]
  Tensor rlogits, probs, rlse, gates;  // linear router
  std::int32_t* idx = nullptr;        // [N top_k]
  std::int64_t* counts = nullptr;     // [E]
  ops::moe::Plan plan;                // the dispatch plan of the last forward
  ops::moe::Saved experts;            // [N top_k, ...]
  zaya::MoeActs zmoe;                 // ZAYA1 stage (its experts' Saved is `experts`)
};
// routing false: a pass that takes another pass's routing (mlp_forward's `routing`: TSP's passes
// over the other ranks' weight shards) keeps no router state or dispatch indices of its own.
void carve(ArenaPlanner& p, const std::string& prefix, const MlpShape& s, bool dense, bool routed, MlpSaved& a,
           bool routing = true);

// Scratch shared by every layer (contents ignored between calls); `tmp` [N, D] is the caller's.
struct MlpScratch {
  Tensor dg, du, da;        // backward, dense [N, F]
  Tensor dgates, dlogits;   // backward, linear router
  Tensor moe;               // backward: moe::backward_scratch_floats
  zaya::MoeScratch zs;      // ZAYA1 stage, forward and backward
  Tensor tmp;               // [N, D]: one projection's input gradient before it is summed
};
void carve(ArenaPlanner& p, const MlpShape& s, bool dense, bool routed, bool backward, MlpScratch& sc);

// The ZAYA1 stage's EDA chain: this stage writes its state, reads the previous stage's (empty on
// the first); backward reads dL/d its state from the next stage (empty on the last) and writes
// dL/d the previous stage's (empty on the first).
struct EdaIo {
  Tensor state, prev;
};
struct EdaGrads {
  Tensor dstate_next, dprev;
};

// The router losses of a linear-router layer (unweighted; the MLP router has none).
struct RouterLosses {
  double aux = 0, z = 0;
};

// bias: this layer's router selection bias [classes]. load: when not null, this layer's routing
// counts (E experts, + the skip class) of this rank's tokens are added into it; losses likewise.
// tokens: the ranks sharing the micro-batch's sequences; the routers' aux loss takes its
// expert shares f_e over all of their tokens (router::aux_loss), its P_e over this rank's (the
// MLP router's over all its classes, skip included; it has no z loss).
// routing: null, or a pass over the same tokens that routed them (TSP: a layer's later weight
// shards): this pass takes its routing (a's router views point at routing's) and runs no router,
// adds no load and no losses.
void mlp_forward(const MlpShape& s, const LayerWeights& w, const Tensor& bias, const Tensor& x, const EdaIo& eda,
                 MlpSaved& a, const MlpScratch& sc, const Tensor& y, LinearRunner& linear,
                 ops::moe::ExpertRunner* experts, std::int64_t* load, RouterLosses* losses,
                 TokenGroup& tokens = local_tokens(), const MlpSaved* routing = nullptr);

// Passes that share one routing (mlp_forward's `routing`) share its backward too: each adds its
// dL/d gates into `dgates` ([N top_k]; the first pass writes it), and only the last runs the
// router's backward, on their sum (its losses' gradients, its share of dx, its EDA gradient).
struct SharedRouting {
  bool first = true, last = true;
  Tensor dgates;
};

// aux_weight, z_weight: the router's loss weights times the loss scale (the MLP router takes the
// aux weight only).
void mlp_backward(const MlpShape& s, const LayerWeights& w, LayerWeights& g, const Tensor& x, const EdaIo& eda,
                  const EdaGrads& deda, MlpSaved& a, const MlpScratch& sc, const Tensor& dy, const Tensor& dx,
                  float aux_weight, float z_weight, LinearRunner& linear, ops::moe::ExpertRunner* experts,
                  TokenGroup& tokens = local_tokens(), const SharedRouting* shared = nullptr);

}  // namespace keel::blocks

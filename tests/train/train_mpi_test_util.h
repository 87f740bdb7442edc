// What the multi-rank training tests share (data parallel, expert parallel, on CPU ranks and on
// GPUs): the world as a training context, the Muon optimizer section and the ZAYA1 router
// settings they train with.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "parallel/mesh.h"

namespace keel::train::fixtures {

// Every rank of MPI_COMM_WORLD as the data-parallel group, with expert parallelism of degree
// `ep` over consecutive ranks (collective).
inline parallel::Mesh world_context(int ep = 1) {
  mesh::Shape s;
  s.dp = test::world_size();
  s.ep = ep;
  s.zero = 1;
  return parallel::Mesh(s, MPI_COMM_WORLD);
}

// The optimizer section's extra lines for Muon (train_config_text's optimizer_extra).
inline const std::string kMuonOptimizer = "  muon:\n    enabled: true\n";

// ZAYA1's MoE stage: the 3-layer MLP router (top-1) with the skip class. router.init_gain 0
// (normal(0, 0.02) everywhere): the bias leads the routing, so no token sits within rounding of
// a tie between two classes; with the fan-in init (keel train's default) a last-bit difference
// between an expert-parallel and a one-rank run (their expert sums run in other orders) flips a
// near-tied token within a few steps (7e-4 relative in the parameters at 2 ranks).
inline const std::vector<std::string> kZayaRouterSets = {"model.router_hidden=8", "model.router_mlp_layers=3",
                                                         "model.top_k=1", "model.router_skip_expert=true",
                                                         "router.init_gain=0", "router.aux_loss_weight=0"};

// A ZAYA1-shaped tiny model: CCA (4 query heads of 4, 2 kv heads), the MLP router with the skip
// class, residual scaling, tied embeddings (--set lines over train_config_text's tiny MoE). No
// aux loss, as ZAYA1 (the fixture's 0.01 would otherwise reach the MLP router; kZayaAux has it).
inline const std::vector<std::string> kZaya = {"model.attention=cca",         "model.cca_q_dim=16",
                                               "model.cca_k_dim=8",           "model.cca_v_dim=8",
                                               "model.cca_conv_width=2",      "model.cca_group_conv_width=2",
                                               "model.residual_scaling=true", "model.tied_embeddings=true",
                                               "model.router_hidden=8",       "model.router_mlp_layers=3",
                                               "model.top_k=1",               "model.router_skip_expert=true",
                                               "router.aux_loss_weight=0"};

// Layer 1 of 2 slides over 5 tokens with its own RoPE: the window and the layer's table must
// reach the blocks through a scheme's runners (and cross its rank boundaries).
inline const std::vector<std::string> kSliding = {"model.layer_sliding=[false, true]", "model.sliding_window=5",
                                                  "model.sliding_rope_base=500", "model.sliding_rope_fraction=0.5"};

inline std::vector<std::string> joined(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// kZaya with the MLP router's load-balancing loss on (router.aux_loss_weight, ZAYA1 has none).
inline const std::vector<std::string> kZayaAux = joined(kZaya, {"router.aux_loss_weight=0.05"});

// Linear attention (LASP-2's layers): every layer linear, decayed (RetNet), elu+1 features, chunks
// of 2 tokens (each rank's runs span several); and a LASP-2H hybrid, layer 0 linear (identity
// features, no decay) and layer 1 softmax gqa.
inline const std::vector<std::string> kLinear = {"model.attention=linear", "model.linear_chunk=2",
                                                 "model.linear_feature=elu1", "model.linear_decay=retnet"};
inline const std::vector<std::string> kHybrid = {"model.layer_attention=[linear, gqa]", "model.linear_chunk=4"};

// kZaya at the sizes the CUDA kernels take: CCA with 4 query heads and 2 kv heads of 64.
inline const std::vector<std::string> kZayaGpu = joined(kZaya, {"model.cca_q_dim=256", "model.cca_k_dim=128",
                                                                 "model.cca_v_dim=128", "model.router_hidden=64"});

}  // namespace keel::train::fixtures

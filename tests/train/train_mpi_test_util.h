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
                                                         "router.init_gain=0"};

}  // namespace keel::train::fixtures

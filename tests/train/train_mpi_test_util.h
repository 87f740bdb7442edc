// What the multi-rank training tests share (data parallel, expert parallel, on CPU ranks and on
// GPUs): the world as a training context, the Muon optimizer section and the ZAYA1 router
// settings they train with.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "train/parallel_context.h"

namespace keel::train::fixtures {

// Every rank of MPI_COMM_WORLD as the data-parallel group, with expert parallelism of degree
// `ep` over consecutive ranks (collective when ep > 1).
inline ParallelContext world_context(int ep = 1) {
  ParallelContext c;
  c.data = {test::world_size(), test::world_rank(), MPI_COMM_WORLD};
  return with_expert_parallel(c, ep);
}

// The optimizer section's extra lines for Muon (train_config_text's optimizer_extra).
inline const std::string kMuonOptimizer = "  muon:\n    enabled: true\n";

// ZAYA1's MoE stage: the 3-layer MLP router (top-1) with the skip class.
inline const std::vector<std::string> kZayaRouterSets = {"model.router_hidden=8", "model.router_mlp_layers=3",
                                                         "model.top_k=1", "model.router_skip_expert=true"};

}  // namespace keel::train::fixtures

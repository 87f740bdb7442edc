#include "train/parallel_context.h"

#include <fmt/format.h>

#include <utility>

#include "common/error.h"
#include "common/mpi_session.h"

namespace keel::train {

ParallelContext with_expert_parallel(ParallelContext ctx, int ep) {
  if (ep < 1) throw UsageError(fmt::format("expert-parallel degree must be >= 1, got {}", ep));
  if (ep == 1) return ctx;
  if (ctx.data.size % ep != 0)
    throw UsageError(fmt::format("expert-parallel degree {} does not divide the {} data-parallel ranks", ep, ctx.data.size));
  const int r = ctx.data.rank;
  MPI_Comm expert = MPI_COMM_NULL, replicas = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split(ctx.data.comm, r / ep, r, &expert), "MPI_Comm_split (expert group)");
  mpi_check(MPI_Comm_split(ctx.data.comm, r % ep, r, &replicas), "MPI_Comm_split (expert data group)");
  ctx.expert = {ep, r % ep, expert};
  ctx.expert_data = {ctx.data.size / ep, r / ep, replicas};
  auto comms = std::shared_ptr<std::pair<MPI_Comm, MPI_Comm>>(
      new std::pair<MPI_Comm, MPI_Comm>(expert, replicas), [](std::pair<MPI_Comm, MPI_Comm>* c) {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (!finalized) {
          MPI_Comm_free(&c->first);
          MPI_Comm_free(&c->second);
        }
        delete c;
      });
  ctx.owned = std::move(comms);
  return ctx;
}

}  // namespace keel::train

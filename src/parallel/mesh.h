// The process groups of one run, built once from its mesh shape (mesh/shape.h: the axes pp, dp,
// cp, tsp, tp and the folded ep), validated once, and the owner of every communicator a
// parallel scheme uses: the MPI sub-communicators of each group (made at construction) and the
// NCCL communicators (made the first time a group asks for one). One call aborts them all, for
// the watchdog and, later, the supervisor.
//
// Groups (ranks that differ only in the coordinates named):
//   data         dp and cp: the ranks that train the same weights on other tokens. Gradients of
//                replicated parameters sum over it and ZeRO-1 shards their optimizer state over
//                it. (Without context parallelism it is the dp axis.)
//   expert       ep ranks, consecutive in the data group, holding all experts of a layer
//   expert_data  the data-group ranks holding the same experts: expert gradients sum over it
//   tensor, context, tsp, pipeline: one axis each
// A Mesh is a handle: copies share the communicators, which live until the last copy goes.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "mesh/shape.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {

struct Group {
  int size = 1;
  int rank = 0;
  MPI_Comm comm = MPI_COMM_NULL;  // owned by the Mesh; MPI_COMM_NULL only when size is 1
};

enum class GroupKind { kData, kExpert, kExpertData, kTensor, kContext, kTsp, kPipeline };
inline constexpr int kGroupKinds = 7;
const char* group_name(GroupKind g);  // "data", "expert", ...

class Mesh {
 public:
  // One process alone: every group of one rank, no communicator.
  Mesh();
  // Collective over `world` (every rank calls it together): checks `shape` (mesh::validate, and
  // that it spans the ranks of `world`; keel::UsageError prefixed by `what` otherwise) and splits
  // `world` into its groups.
  Mesh(const mesh::Shape& shape, MPI_Comm world, const std::string& what = "parallel");

  const mesh::Shape& shape() const;
  const mesh::Coord& coord() const;  // this rank's
  int rank() const;                  // in the world of the mesh
  int size() const;
  MPI_Comm world() const;  // the communicator the mesh spans (MPI_COMM_NULL: one process alone)
  const Group& group(GroupKind g) const;
  const Group& data() const { return group(GroupKind::kData); }
  const Group& expert() const { return group(GroupKind::kExpert); }
  const Group& expert_data() const { return group(GroupKind::kExpertData); }

  // The NCCL communicator over group g, made the first time it is asked for: every rank of the
  // group calls this together, with its CUDA device set. Throws keel::Error in a build without
  // CUDA. Lives as long as the mesh.
  std::shared_ptr<NcclGroup> nccl(GroupKind g);
  // A second communicator over group g, for traffic on a side stream beside nccl(g)'s (two
  // streams must not share one communicator): TSP's weight shards. Made like nccl(g).
  std::shared_ptr<NcclGroup> nccl_side(GroupKind g);
  // Aborts every NCCL communicator made so far (side ones too), so that kernels waiting in one of their
  // collectives return (a peer died or hangs): the watchdog calls it before it ends the process.
  // Safe from another thread; the communicators are unusable afterwards.
  void abort_all();

 private:
  struct State;
  std::shared_ptr<State> s_;
};

}  // namespace keel::parallel

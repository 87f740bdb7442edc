// The process groups a training module works in: data, expert, tensor and sequence parallelism.
// Every module (model, trainer, the parallel schemes) takes a ParallelContext so the
// signatures do not change as the groups grow past one rank. Each group carries its size, this
// process's rank in it and its MPI communicator (owned elsewhere; MPI_COMM_NULL: a group of
// this process alone). GPU backends build their NCCL communicators from these.
// Implemented so far: data parallelism with ZeRO-1 (parallel/zero1.h) and expert parallelism
// (parallel/expert_parallel.h on CPU ranks, expert_parallel_cuda.h on GPUs); tensor and
// sequence groups are 1.
//
// Expert parallelism divides the data-parallel group: every rank trains on its own slice of the
// batch (`data` is every rank), `expert` is the group of ep consecutive ranks that together
// hold all experts (rank r of it holds experts [r E/ep, (r+1) E/ep)), and `expert_data` the
// data.size / ep ranks that hold the same experts (their expert gradients reduce over it).
#pragma once

#include <mpi.h>

#include <memory>
#include <optional>

#include "parallel/data_parallel_comm.h"

namespace keel::train {

struct ProcessGroup {
  int size = 1;
  int rank = 0;
  MPI_Comm comm = MPI_COMM_NULL;  // not owned; MPI_COMM_NULL only when size is 1
};

struct ParallelContext {
  ProcessGroup data, expert, expert_data, tensor, sequence;
  std::shared_ptr<void> owned;  // communicators this context created (with_expert_parallel), freed with the last copy
  // Whether this rank trains on its GPU, decided alike on every rank by whoever built the
  // context (keel train: train/command.cc); unset, the Trainer decides from `device` itself.
  std::optional<bool> cuda;
  // The element type gradients are summed in over data (and expert-data) ranks; the Trainer
  // sets it from `parallel.grad_reduce` (parallel/data_parallel_comm.h).
  parallel::GradReduceDtype grad_reduce = parallel::GradReduceDtype::kFp32;

  static ParallelContext single() { return {}; }
  int world_size() const { return data.size * tensor.size * sequence.size; }
};

// `ctx` (its data group: every rank) with expert parallelism of degree `ep`: the expert groups
// are ep consecutive data-parallel ranks. Collective over ctx.data.comm. Throws
// keel::UsageError when ep does not divide the data-parallel group.
ParallelContext with_expert_parallel(ParallelContext ctx, int ep);

}  // namespace keel::train

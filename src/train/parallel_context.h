// The process groups a training module works in: data, expert, tensor and sequence parallelism.
// Every module (model, trainer, later the parallel schemes) takes a ParallelContext from day
// one so the signatures do not change when the groups grow past one rank. Each group carries
// its size, this process's rank in it and an opaque communicator handle (an MPI_Comm or an
// ncclComm_t owned elsewhere; nullptr means "this process alone", MPI_COMM_SELF-like).
// So far only world size 1 is implemented: ParallelContext::single().
#pragma once

#include <fmt/format.h>

#include "common/error.h"

namespace keel::train {

struct ProcessGroup {
  int size = 1;
  int rank = 0;
  void* comm = nullptr;  // opaque, not owned; nullptr: a group of this process alone
};

struct ParallelContext {
  ProcessGroup data, expert, tensor, sequence;

  static ParallelContext single() { return {}; }
  int world_size() const { return data.size * expert.size * tensor.size * sequence.size; }
  // Throws keel::UsageError unless every group has one rank (the CPU path so far).
  void require_single(const char* who) const {
    if (data.size != 1 || expert.size != 1 || tensor.size != 1 || sequence.size != 1)
      throw UsageError(fmt::format("{}: only world size 1 is implemented so far (data {}, expert {}, tensor {}, sequence {})",
                                   who, data.size, expert.size, tensor.size, sequence.size));
  }
};

}  // namespace keel::train

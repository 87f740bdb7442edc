// An NCCL communicator over the ranks of an MPI communicator: rank 0 makes the unique id, MPI
// broadcasts it, every rank joins. The one bootstrap the NCCL users of src/parallel share
// (CUDA builds only: included from *_cuda.cc files).
#pragma once

#include <mpi.h>
#include <nccl.h>

namespace keel::parallel {

// Collective over `comm`, with this rank's CUDA device set. Sets *size and *rank to this rank's
// place in `comm`. Throws keel::Error on an MPI or NCCL error.
ncclComm_t nccl_comm_from_mpi(MPI_Comm comm, int* size, int* rank);

}  // namespace keel::parallel

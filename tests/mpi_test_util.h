// Small helpers shared by the tests that run under mpiexec (tests/**/*_mpi_test.cc).
#pragma once

#include <mpi.h>

namespace keel::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace keel::test

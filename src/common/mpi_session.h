// MPI brings ranks up and down. keel initializes it only in commands that need ranks; with
// no launcher it runs as a world of one.
#pragma once

#include <mpi.h>

#include <string>

namespace keel {

class MpiSession {
 public:
  MpiSession();   // MPI_Init_thread (funneled); safe to construct once per process
  ~MpiSession();  // MPI_Finalize
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string version() const;  // e.g. "Open MPI v4.1.4"

 private:
  int rank_ = 0, size_ = 1;
};

// After an error unwound past a live MpiSession: finalizes MPI when every rank failed the
// same way (`all_ranks_failed`, a usage error), else aborts the whole job so the other ranks
// stop at once instead of waiting in a collective until their --timeout. A no-op when MPI
// was never started or already finalized.
void finish_mpi_after_error(bool all_ranks_failed);

// Throws keel::Error with the MPI error string when `rc` is not MPI_SUCCESS.
void mpi_check(int rc, const char* what);

// Gives every rank of `comm` the `text` of rank `root` (collective; the others' text is replaced).
void broadcast_string(std::string& text, int root, MPI_Comm comm);

}  // namespace keel

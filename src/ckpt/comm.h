// The few collectives the commit protocol needs, behind an interface so the library runs
// under MPI and, as a world of one, in plain unit tests and offline tools. Called only from
// the thread that owns the checkpointer (MPI_THREAD_FUNNELED is enough).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <mpi.h>

namespace keel::ckpt {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank's string at rank 0 (others get an empty vector).
  virtual std::vector<std::string> gather(const std::string& mine) = 0;
  // Rank 0's string on every rank.
  virtual std::string bcast(const std::string& from_root) = 0;
};

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm);
std::unique_ptr<Comm> make_self_comm();

}  // namespace keel::ckpt

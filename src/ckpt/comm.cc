#include "ckpt/comm.h"

#include "common/mpi_session.h"
#include "common/watchdog.h"

namespace keel::ckpt {
namespace {

class MpiComm : public Comm {
 public:
  explicit MpiComm(MPI_Comm c) : c_(c) {
    MPI_Comm_rank(c_, &rank_);
    MPI_Comm_size(c_, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<std::string> gather(const std::string& mine) override {
    int n = static_cast<int>(mine.size());
    std::vector<int> counts(rank_ == 0 ? size_ : 0), displs;
    PeerWait wait("MPI_Gather (checkpoint commit)");
    mpi_check(MPI_Gather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, c_), "MPI_Gather");
    std::string all;
    if (rank_ == 0) {
      displs.resize(size_);
      int total = 0;
      for (int r = 0; r < size_; ++r) displs[r] = total, total += counts[r];
      all.resize(static_cast<std::size_t>(total));
    }
    mpi_check(MPI_Gatherv(mine.data(), n, MPI_CHAR, all.data(), counts.data(), displs.data(), MPI_CHAR, 0, c_),
              "MPI_Gatherv");
    std::vector<std::string> out;
    for (int r = 0; rank_ == 0 && r < size_; ++r) out.push_back(all.substr(displs[r], counts[r]));
    return out;
  }
  std::string bcast(const std::string& from_root) override {
    std::string s = from_root;
    broadcast_string(s, 0, c_);
    return s;
  }

 private:
  MPI_Comm c_;
  int rank_ = 0, size_ = 1;
};

class SelfComm : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<std::string> gather(const std::string& mine) override { return {mine}; }
  std::string bcast(const std::string& from_root) override { return from_root; }
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm) { return std::make_unique<MpiComm>(comm); }
std::unique_ptr<Comm> make_self_comm() { return std::make_unique<SelfComm>(); }

}  // namespace keel::ckpt

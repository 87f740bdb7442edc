#include "common/mpi_session.h"

#include <cstdio>
#include <exception>

#include "common/error.h"
#include "common/watchdog.h"

namespace keel {

void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail("MPI call {} failed: {}", what, std::string(text, static_cast<size_t>(len)));
}

void broadcast_string(std::string& text, int root, MPI_Comm comm) {
  PeerWait wait("MPI_Bcast");
  int n = static_cast<int>(text.size());
  mpi_check(MPI_Bcast(&n, 1, MPI_INT, root, comm), "MPI_Bcast");
  text.resize(static_cast<std::size_t>(n));
  mpi_check(MPI_Bcast(text.data(), n, MPI_CHAR, root, comm), "MPI_Bcast");
}

MpiSession::MpiSession() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  }
  // Errors come back as codes so they become one-line keel errors instead of MPI's abort.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

namespace {
// Set when an error unwinds past a session of several ranks: main() decides, after printing
// the error, whether to finalize or abort (finalizing first could block on the other ranks).
bool g_unwound_with_peers = false;
}  // namespace

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (std::uncaught_exceptions() > 0 && size_ > 1) {
    g_unwound_with_peers = true;
    return;
  }
  MPI_Finalize();
}

void finish_mpi_after_error(bool all_ranks_failed) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  if (g_unwound_with_peers && !all_ranks_failed) {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kExitError);
  }
  MPI_Finalize();
}

std::string MpiSession::version() const {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  std::string v(text, static_cast<size_t>(len));
  if (auto nl = v.find_first_of("\n,"); nl != std::string::npos) v.resize(nl);
  return v;
}

}  // namespace keel

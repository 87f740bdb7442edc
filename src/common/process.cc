#include "common/process.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

namespace keel {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return std::atoi(v);
}

int g_exit_code = 0;

}  // namespace

int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    int r = env_int(name, -1);
    if (r >= 0) return r;
  }
  return 0;
}

// srun's step size, not SLURM_NTASKS: a Slurm batch script has that too, and a command run there
// once (keel run, keel data) is no rank of several.
int launcher_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    int n = env_int(name, -1);
    if (n > 0) return n;
  }
  return 1;
}

bool launched_as_rank() { return launcher_size() > 1; }

void report_error(const std::string& message) {
  if (launcher_size() > 1)
    std::fprintf(stderr, "keel: error: [rank %d] %s\n", launcher_rank(), message.c_str());
  else
    std::fprintf(stderr, "keel: error: %s\n", message.c_str());
  std::fflush(stderr);
}

void report_warning(const std::string& message) {
  if (launcher_rank() > 0) return;
  std::fprintf(stderr, "keel: warning: %s\n", message.c_str());
  std::fflush(stderr);
}

void warn_deprecated_flag(const std::string& command, const std::string& old_flag, const std::string& new_flag,
                          const std::string& why) {
  report_warning(fmt::format("{}: {} is deprecated, use {}{}", command, old_flag, new_flag,
                             why.empty() ? "" : fmt::format(" ({})", why)));
}

void set_exit_code(int code) { g_exit_code = code; }
int exit_code() { return g_exit_code; }

}  // namespace keel

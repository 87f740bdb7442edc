// Process-wide facts and conventions shared by every subcommand: which rank this process is
// under a launcher, how errors are printed, and the exit code a command chose.
#pragma once

#include <string>

namespace keel {

// This process's rank as the launcher set it (mpirun, srun), before MPI is initialized;
// 0 without a launcher.
int launcher_rank();
// The world size the launcher set (mpirun's or PMI's size, or srun's step: SLURM_STEP_NUM_TASKS;
// a Slurm batch script's SLURM_NTASKS alone makes none); 1 without a launcher.
int launcher_size();
// Whether this process is one rank of several that a launcher started (launcher_size() > 1):
// keel run, which runs once in the batch script and launches the ranks, refuses to be one.
bool launched_as_rank();

// Prints "keel: error: <message>" on stderr. Under a launcher with several ranks, the rank
// is named so a failing rank can be found among many.
void report_error(const std::string& message);

// Prints "keel: warning: <message>" on stderr, once per job: under a launcher every rank parses
// the same flags, so only rank 0 speaks.
void report_warning(const std::string& message);

// An old spelling of a flag that still works: one warning naming the new one, e.g.
// "keel: warning: generate: -n is deprecated, use --max-new-tokens (-n means --iters in keel
// bench)". `why` may be empty.
void warn_deprecated_flag(const std::string& command, const std::string& old_flag, const std::string& new_flag,
                          const std::string& why);

// The exit code a command wants main() to return (commands run inside CLI11 callbacks).
void set_exit_code(int code);
int exit_code();

}  // namespace keel

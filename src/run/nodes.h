// The nodes of a multi-node keel run job (docs/fault_tolerance.md, "Several nodes"): with
// `--hosts FILE` (mpirun's host file) or `--launcher srun` (inside a Slurm allocation) a failing
// or straggling device takes its whole node out of the job, so every node left runs the same
// ranks. The next attempt's launch leaves the excluded nodes out: mpirun gets a copy of the
// host file without them, srun `--exclude=NODE,...`.
#pragma once

#include <string>
#include <vector>

namespace keel::run {

// The host names of an mpirun host file, in order (the first word of each line; blank lines and
// '#' comments skipped). keel::Error naming the file when it cannot be read or names no host.
std::vector<std::string> read_hostfile(const std::string& path);

// Writes `from` to `to` without the lines of the hosts in `out` (comments and blank lines
// kept). keel::Error when nothing is left or a file cannot be read or written.
void write_hostfile_without(const std::string& from, const std::vector<std::string>& out, const std::string& to);

// The launcher's arguments that start `ranks` ranks: mpirun -np RANKS ... [--hostfile FILE], or
// srun --ntasks=RANKS --kill-on-bad-exit=1 [--exclude=NODE,...]. Empty for one rank under mpirun
// (keel train runs alone).
std::vector<std::string> launch_args(const std::string& launcher, int ranks, const std::string& hostfile,
                                     const std::vector<std::string>& excluded_nodes);

}  // namespace keel::run

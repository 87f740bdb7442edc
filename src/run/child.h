// How keel run starts a process (the job's launcher or keel train, and the pre-flight's
// benchmarks): in a process group of its own (so the whole job can be signalled), with
// SIGINT and SIGTERM at their defaults, stdout and stderr on a descriptor the caller gives.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace keel::run {

// Forks and execs argv (PATH searched) with stdout and stderr on `out` (closed in the child,
// left open here, as is `close_in_child` there when >= 0: the other end of a pipe). Returns the
// child's pid, also its process group. keel::Error when fork fails; a program that cannot start
// prints one line on `out` and exits 127.
pid_t fork_exec(const std::vector<std::string>& argv, int out, int close_in_child = -1);

}  // namespace keel::run

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

// Waits up to `seconds` for every process of `pids` (on this host) to be gone, and returns those
// still there. Gone: no such process, or a zombie whose threads have all exited (its files, and
// so a flock a rank held, are released by then; it waits only on its parent's reaping). A rank
// killed while a GPU kernel of its spins on a peer takes seconds to tear down its device
// context, and holds its output directory's lock until then.
std::vector<pid_t> wait_gone(const std::vector<pid_t>& pids, double seconds);

// Waits up to `seconds` for the keel lock of directory `dir` (common/dir_lock.h) to be free,
// taking and dropping it to see: the lock of a rank on another host that shares the directory
// (where no pid of it can be looked at from here), or of one whose pid was never reported.
// Returns "" once free (or when `dir` does not exist or its file system has no locks), else
// the holder's line.
std::string wait_unlocked(const std::string& dir, double seconds);

}  // namespace keel::run

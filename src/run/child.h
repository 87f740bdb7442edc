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

// What one thread of a process is doing, from /proc/PID/task/TID (Linux): its name, its
// scheduler state (R running, S sleeping, D in uninterruptible wait, ...), the kernel function
// it waits in (wchan; "" when the kernel hides it), its system call (number and arguments, or
// "running"), and its kernel stack's functions (only where /proc lets this process read them:
// root, or the owner with ptrace rights).
struct ThreadState {
  int tid = 0;
  std::string name;
  char state = '?';
  std::string wchan;
  std::string syscall;
  std::vector<std::string> kernel_stack;  // innermost first, "func" without offsets
};

// Every thread of `pid` as /proc shows it now; empty when the process is gone or unreadable.
// A hung rank's fault report names what its threads were waiting in (a stalled write, a lock,
// a driver call), which the heartbeats alone cannot tell apart.
std::vector<ThreadState> thread_states(pid_t pid);

// One line for a report: the main thread (tid == pid) first, then the other threads that are
// not plainly asleep (state other than S, or S in a wait that is not a futex, poll or sleep),
// up to `limit` of them, then how many sleep. E.g. "main D in folio_wait_bit (syscall 1, write);
// keel-ckpt S in pipe_read; 14 others asleep".
std::string describe_threads(const std::vector<ThreadState>& threads, pid_t pid, int limit = 6);

}  // namespace keel::run

#include "run/child.h"

#include <dirent.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "common/dir_lock.h"
#include "common/error.h"

namespace keel::run {

pid_t fork_exec(const std::vector<std::string>& argv, int out, int close_in_child) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) fail("run: fork: {}", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    signal(SIGINT, SIG_DFL), signal(SIGTERM, SIG_DFL);
    dup2(out, 1), dup2(out, 2);
    close(out);
    if (close_in_child >= 0) close(close_in_child);
    execvp(args[0], args.data());
    std::fprintf(stderr, "keel: error: run: cannot start %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  return pid;
}

namespace {

// A zombie's /proc/PID/stat state is Z while other threads of it may still be exiting; it has
// let go of everything once its task directory lists the leader alone.
bool exited(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string dir = "/proc/" + std::to_string(pid);
  std::ifstream stat(dir + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // gone between the two looks
  const auto paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z') return false;
  int tasks = 0;
  if (DIR* d = opendir((dir + "/task").c_str())) {
    while (const dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++tasks;
    closedir(d);
  }
  return tasks <= 1;
}

}  // namespace

std::vector<pid_t> wait_gone(const std::vector<pid_t>& pids, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<pid_t> left;
  for (;;) {
    left.clear();
    for (const pid_t p : pids)
      if (p > 0 && !exited(p)) left.push_back(p);
    if (left.empty() || std::chrono::steady_clock::now() >= until) return left;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string wait_unlocked(const std::string& dir, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) return "";
    DirLock::Result r = DirLock::acquire(dir, lock_holder_line("keel run: seeing that the job let go"));
    if (r.lock || !r.unsupported.empty()) return "";  // free: dropped again as r goes
    if (std::chrono::steady_clock::now() >= until) return r.holder.empty() ? "(a holder that wrote no line)" : r.holder;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

namespace {

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// The system calls a stalled rank is likely to sit in, by number (this machine's numbering).
std::string syscall_name(long n) {
  switch (n) {
#define KEEL_SYSCALL(x) \
  case SYS_##x:         \
    return #x;
#ifdef SYS_read
    KEEL_SYSCALL(read)
#endif
#ifdef SYS_write
    KEEL_SYSCALL(write)
#endif
#ifdef SYS_pread64
    KEEL_SYSCALL(pread64)
#endif
#ifdef SYS_pwrite64
    KEEL_SYSCALL(pwrite64)
#endif
#ifdef SYS_openat
    KEEL_SYSCALL(openat)
#endif
#ifdef SYS_close
    KEEL_SYSCALL(close)
#endif
#ifdef SYS_fsync
    KEEL_SYSCALL(fsync)
#endif
#ifdef SYS_fdatasync
    KEEL_SYSCALL(fdatasync)
#endif
#ifdef SYS_sync_file_range
    KEEL_SYSCALL(sync_file_range)
#endif
#ifdef SYS_fadvise64
    KEEL_SYSCALL(fadvise64)
#endif
#ifdef SYS_renameat
    KEEL_SYSCALL(renameat)
#endif
#ifdef SYS_rename
    KEEL_SYSCALL(rename)
#endif
#ifdef SYS_renameat2
    KEEL_SYSCALL(renameat2)
#endif
#ifdef SYS_ioctl
    KEEL_SYSCALL(ioctl)
#endif
#ifdef SYS_futex
    KEEL_SYSCALL(futex)
#endif
#ifdef SYS_poll
    KEEL_SYSCALL(poll)
#endif
#ifdef SYS_ppoll
    KEEL_SYSCALL(ppoll)
#endif
#ifdef SYS_epoll_wait
    KEEL_SYSCALL(epoll_wait)
#endif
#ifdef SYS_epoll_pwait
    KEEL_SYSCALL(epoll_pwait)
#endif
#ifdef SYS_select
    KEEL_SYSCALL(select)
#endif
#ifdef SYS_pselect6
    KEEL_SYSCALL(pselect6)
#endif
#ifdef SYS_nanosleep
    KEEL_SYSCALL(nanosleep)
#endif
#ifdef SYS_clock_nanosleep
    KEEL_SYSCALL(clock_nanosleep)
#endif
#ifdef SYS_pause
    KEEL_SYSCALL(pause)
#endif
#ifdef SYS_sched_yield
    KEEL_SYSCALL(sched_yield)
#endif
#ifdef SYS_mmap
    KEEL_SYSCALL(mmap)
#endif
#ifdef SYS_munmap
    KEEL_SYSCALL(munmap)
#endif
#ifdef SYS_madvise
    KEEL_SYSCALL(madvise)
#endif
#ifdef SYS_mprotect
    KEEL_SYSCALL(mprotect)
#endif
#ifdef SYS_wait4
    KEEL_SYSCALL(wait4)
#endif
#undef KEEL_SYSCALL
    default:
      return "";
  }
}

// "1 0x3 0x7f.. ..." -> "write"; "running" stays; an unknown number stays a number
std::string syscall_label(const std::string& text) {
  std::istringstream in(text);
  std::string first;
  in >> first;
  if (first.empty() || first == "running") return first;
  char* end = nullptr;
  const long n = std::strtol(first.c_str(), &end, 10);
  if (end == first.c_str() || *end != '\0') return first;
  if (n < 0) return "none";  // -1: blocked outside any system call (a page fault, say)
  const std::string name = syscall_name(n);
  return name.empty() ? "syscall " + first : name;
}

bool plainly_asleep(const ThreadState& t) {
  if (t.state != 'S') return false;
  static const char* const waits[] = {"futex", "poll", "epoll_wait", "epoll_pwait", "ppoll", "select", "pselect6",
                                      "nanosleep", "clock_nanosleep", "wait4", "pause"};
  const std::string call = syscall_label(t.syscall);
  for (const char* w : waits)
    if (call == w) return true;
  if (!call.empty()) return false;
  for (const char* w : {"futex", "poll", "sleep", "select"})  // no syscall file: the wait channel
    if (t.wchan.find(w) != std::string::npos) return true;
  return false;
}

}  // namespace

std::vector<ThreadState> thread_states(pid_t pid) {
  std::vector<ThreadState> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  std::vector<int> tids;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] >= '0' && e->d_name[0] <= '9') tids.push_back(std::atoi(e->d_name));
  closedir(d);
  std::sort(tids.begin(), tids.end());
  for (const int tid : tids) {
    const std::string t = dir + "/" + std::to_string(tid);
    ThreadState s;
    s.tid = tid;
    s.name = read_line(t + "/comm");
    const std::string stat = read_line(t + "/stat");
    const auto paren = stat.rfind(')');
    if (stat.empty() || paren == std::string::npos) continue;  // exited between the looks
    if (paren + 2 < stat.size()) s.state = stat[paren + 2];
    s.wchan = read_line(t + "/wchan");
    if (s.wchan == "0") s.wchan.clear();  // running, or hidden from this process
    s.syscall = read_line(t + "/syscall");
    std::ifstream stack(t + "/stack");
    for (std::string line; std::getline(stack, line);) {  // "[<0>] folio_wait_bit_common+0x13c/0x350"
      auto b = line.find("] ");
      if (b == std::string::npos) continue;
      std::string f = line.substr(b + 2);
      f = f.substr(0, f.find('+'));
      if (!f.empty()) s.kernel_stack.push_back(f);
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::string describe_threads(const std::vector<ThreadState>& threads, pid_t pid, int limit) {
  if (threads.empty()) return "its threads could not be read";
  const auto one = [&](const ThreadState& t) {
    std::string s = fmt::format("{} {}", t.tid == pid ? "main" : t.name, t.state);
    std::string where;
    for (std::size_t i = 0; i < t.kernel_stack.size() && i < 3; ++i)
      where += (i ? " < " : "") + t.kernel_stack[i];
    if (where.empty()) where = t.wchan;
    if (!where.empty()) s += " in " + where;
    const std::string call = syscall_label(t.syscall);
    if (!call.empty() && call != "running") s += " (" + call + ")";
    return s;
  };
  std::vector<std::string> parts;
  int asleep = 0, shown = 0, hidden = 0;
  for (const auto& t : threads)
    if (t.tid == pid) parts.push_back(one(t));
  for (const auto& t : threads) {
    if (t.tid == pid) continue;
    if (plainly_asleep(t)) {
      ++asleep;
    } else if (shown >= limit) {
      ++hidden;
    } else {
      parts.push_back(one(t));
      ++shown;
    }
  }
  if (hidden > 0) parts.push_back(fmt::format("{} more awake", hidden));
  if (asleep > 0) parts.push_back(fmt::format("{} other{} asleep", asleep, asleep == 1 ? "" : "s"));
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : "; ") + p;
  return s;
}

}  // namespace keel::run

#include "run/child.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

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

}  // namespace keel::run

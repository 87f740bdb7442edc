#include "run/child.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

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

}  // namespace keel::run

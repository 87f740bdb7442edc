// install_stack_dump (common/stack_dump.h): SIGUSR2 to a thread writes that thread's stack to
// stderr, names the thread and whether it is the main one, and the process goes on.
#include "common/stack_dump.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>

// Exported (keel_tests links with ENABLE_EXPORTS) and not inlined: the frame the dump must name.
extern "C" __attribute__((noinline)) void keel_stack_dump_test_waits_here(int ready_fd) {
  const char r = 'r';
  (void)!::write(ready_fd, &r, 1);
  for (;;) ::pause();
}

namespace keel {
namespace {

// Reads `fd` until `want` appears in what was read, EOF or `seconds` pass.
std::string read_until(int fd, const std::string& want, double seconds) {
  std::string got;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (got.find(want) == std::string::npos && std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    got.append(buf, static_cast<std::size_t>(n));
  }
  return got;
}

TEST(StackDump, Sigusr2WritesTheMainThreadsStackAndTheProcessGoesOn) {
  int err[2], ready[2];
  ASSERT_EQ(::pipe(err), 0);
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(err[1], STDERR_FILENO);
    ::close(err[0]), ::close(ready[0]);
    install_stack_dump();
    keel_stack_dump_test_waits_here(ready[1]);
  }
  ::close(err[1]), ::close(ready[1]);
  char r = 0;
  ASSERT_EQ(::read(ready[0], &r, 1), 1);
  ASSERT_EQ(::syscall(SYS_tgkill, pid, pid, SIGUSR2), 0);
  const std::string got = read_until(err[0], "keel_stack_dump_test_waits_here", 10.0);
  const bool alive = ::kill(pid, 0) == 0 && ::waitpid(pid, nullptr, WNOHANG) == 0;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  ::close(err[0]), ::close(ready[0]);
  EXPECT_NE(got.find("keel: stack of thread " + std::to_string(pid) + " (main), on request (SIGUSR2):\n"),
            std::string::npos)
      << got;
  EXPECT_NE(got.find("keel_stack_dump_test_waits_here"), std::string::npos) << got;
  EXPECT_TRUE(alive) << "the dump must not end the process";
}

}  // namespace
}  // namespace keel

#include "common/stack_dump.h"

#include <execinfo.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/process.h"

static_assert(keel::kStackDumpSignal == SIGUSR2, "kStackDumpSignal is SIGUSR2");

namespace keel {
namespace {

char g_who[64];  // "keel: [rank 3] " or "keel: ", written before the handler is installed

void say(const char* text, std::size_t n) {  // async-signal-safe
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w, n -= static_cast<std::size_t>(w);
  }
}

// Decimal digits of v into buf (no snprintf in a handler); returns the length.
std::size_t digits(long v, char* buf) {
  char tmp[24];
  std::size_t n = 0;
  do tmp[n++] = static_cast<char>('0' + v % 10);
  while ((v /= 10) > 0 && n < sizeof tmp);
  for (std::size_t i = 0; i < n; ++i) buf[i] = tmp[n - 1 - i];
  return n;
}

void on_dump(int) {
  const int saved = errno;
  void* frames[64];
  const int n = ::backtrace(frames, 64);  // loaded at install: no allocation here
  char head[160];
  std::size_t len = 0;
  const auto put = [&](const char* s) {
    const std::size_t k = std::strlen(s);
    std::memcpy(head + len, s, k);
    len += k;
  };
  put(g_who);
  put("stack of thread ");
  len += digits(static_cast<long>(::syscall(SYS_gettid)), head + len);
  put(::syscall(SYS_gettid) == ::getpid() ? " (main)" : "");
  put(", on request (SIGUSR2):\n");
  say(head, len);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  errno = saved;
}

}  // namespace

void install_stack_dump() {
  const std::string who = launcher_size() > 1 ? "keel: [rank " + std::to_string(launcher_rank()) + "] " : "keel: ";
  std::snprintf(g_who, sizeof g_who, "%s", who.c_str());
  void* warm[2];
  ::backtrace(warm, 2);  // the first call loads libgcc's unwinder (it allocates): not in the handler
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_dump;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // the interrupted call goes on
  sigaction(SIGUSR2, &sa, nullptr);
}

}  // namespace keel

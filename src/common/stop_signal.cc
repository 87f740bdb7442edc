#include "common/stop_signal.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/process.h"

namespace keel {
namespace {

volatile std::sig_atomic_t g_signal = 0;
// Written by install_stop_signals(), only read by the handler: [signal][first, second].
char g_text[2][2][256];

void say(const char* text) {  // async-signal-safe
  const ssize_t n = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)n;
}

void on_signal(int sig) {
  const int which = sig == SIGINT ? 0 : 1;
  if (g_signal == 0) {
    g_signal = sig;
    say(g_text[which][0]);
    return;
  }
  say(g_text[which][1]);
  ::_exit(128 + sig);
}

}  // namespace

void install_stop_signals() {
  // Under a launcher the line names the rank: a signal may reach one rank or all.
  const std::string who = launcher_size() > 1 ? "keel: [rank " + std::to_string(launcher_rank()) + "] " : "keel: ";
  for (int which = 0; which < 2; ++which) {
    const char* name = which == 0 ? "SIGINT" : "SIGTERM";
    std::snprintf(g_text[which][0], sizeof g_text[which][0],
                  "%s%s received: stopping at the next step boundary, after saving a checkpoint there (a second "
                  "signal exits at once)\n",
                  who.c_str(), name);
    std::snprintf(g_text[which][1], sizeof g_text[which][1], "%ssecond signal (%s): exiting at once, without saving\n",
                  who.c_str(), name);
  }
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // interrupted system calls go on: only the flag changes
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return static_cast<int>(g_signal); }

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "a signal";
  }
}

}  // namespace keel

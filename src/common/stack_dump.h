// A thread's call stack on request: once install_stack_dump() has run, SIGUSR2 sent to a
// thread (tgkill) makes that thread write its own stack to stderr and go on where it was.
// keel run sends it to a hung rank's main thread before it kills the rank, so the fault names
// the function the rank was stuck in, not only its kernel wait (run/child.h thread_states).
// Frames are named where the binary exports its symbols (keel is linked with them: -rdynamic);
// the libraries' frames by their exported names, or library + offset.
#pragma once

namespace keel {

// The signal the dump answers to.
inline constexpr int kStackDumpSignal = 12;  // SIGUSR2 on Linux

// Installs the handler (process-wide; the header line names the launcher's rank, as
// install_stop_signals does). Safe to call more than once.
void install_stack_dump();

}  // namespace keel

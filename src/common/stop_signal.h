// A clean stop on SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption): the first signal only
// records itself, for the program to stop at its next safe point (keel train: the next step
// boundary, after saving a checkpoint); a second one ends the process at once
// (_exit(128 + signal)), saving nothing more.
#pragma once

namespace keel {

// Installs the handlers (process-wide; call once, after MPI is initialized so they are the ones
// in place).
void install_stop_signals();
// The first SIGINT or SIGTERM received since install_stop_signals(), or 0.
int stop_signal();
// "SIGINT", "SIGTERM" (any other: "a signal").
const char* signal_name(int sig);

}  // namespace keel

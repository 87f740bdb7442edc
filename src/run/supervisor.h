// `keel run`: the supervisor that keeps a training job going through faults (docs/
// fault_tolerance.md). It launches `keel train` (one process, or N ranks under mpirun), watches
// it, and after a fault restarts it from the newest committed checkpoint until the configured
// steps are done. It never runs inside a rank: src/train/ does not include it; it drives keel
// train through its flags (--heartbeat, --resume, --skip-step, --inject) and its output.
//
// Detection, each with its latency:
//   dead rank   a rank's process is gone (its heartbeat names its pid; checked every poll) or
//               the launcher exited with an error;
//   hung rank   a rank's heartbeat is older than a deadline that adapts to the run: hang_factor
//               x the median step time of this attempt, at least min_deadline (start_deadline
//               before the first step); the job's processes are then killed, after the
//               fault has recorded what this host's ranks were doing: each thread's kernel
//               wait (run/child.h thread_states, in the fault event's "threads") and each
//               main thread's own stack (SIGUSR2, common/stack_dump.h: in the attempt's log);
//   NaN / inf   keel train stops with "step S: loss is nan" (or a non-finite gradient norm):
//               the restart resumes from the last checkpoint and skips step S's data;
//   loss spike  keel train stops with "step S: loss X is a spike (...)" (fault.loss_spike_*):
//               handled as a NaN;
//   disk full   keel train exits with an error naming "No space left on device" (a checkpoint
//               write failed; nothing was committed): restarted from the previous checkpoint;
//   early exit  keel train exited 0 before its last step without being asked to stop.
// Before each attempt, with --preflight: keel's microbenchmarks on every rank (run/preflight.h).
// A rank that fails the gate is named and its device taken out of the job: the next attempt runs
// one rank fewer on this node (GPUs: CUDA_VISIBLE_DEVICES without it), the global batch kept
// (batch.grad_accum over the data ranks left; the checkpoint reshards), when the layout still
// divides; the device goes on the bad list (<output_dir>/run_excluded.json), which later keel
// run invocations on the run apply from their start. With --no-exclude, or when the job cannot
// shrink, the job stops before the attempt, nothing lost. On several nodes (--hosts, --launcher
// srun) the failing device's whole node leaves (run/nodes.h): mpirun's host file without it,
// srun --exclude.
// With --exclude-stragglers a straggler's device is taken out the same way: the job saves at its
// next step, stops, and the next attempt resumes on the other ranks (not a fault: no back-off).
// Reported, not a fault (the job goes on):
//   straggler   a rank whose own work per step (its step time less the time it waited on the
//               others, from its heartbeat) stays well above the other ranks' (run/straggler.h):
//               one line naming its rank, host and pid, and a "straggler" event (kind host);
//   GPU straggler on GPUs, a rank whose device canary (a fixed loop on every SM after each step,
//               its fastest SM's time: the heartbeat's device_seconds) stays well above the
//               other ranks':
//               the same line with "GPU straggler", a "straggler" event of kind device.
// Restart: from `latest` of the run's checkpoint root (committed atomically by keel train: a
// torn save is never `latest`) once it verifies (ckpt::verify_checkpoint; a newer one that does
// not, its files damaged since, is moved aside and `latest` points at the one before), after a
// back-off doubling from `backoff` up to `backoff_max`;
// at most max_restarts. A stop signal (SIGINT, SIGTERM) is passed on: keel train saves at its
// next step boundary and exits 0; the supervisor waits up to `grace` seconds.
//
// Events (one JSON object per line, events file): start, fault (kind, rank, host, pid, step,
// detect_seconds; a hang also threads), straggler (rank, host, pid, step, busy and others' busy seconds), restart (resume step, steps lost, back-off), done / give_up, and a summary:
// faults survived by kind and the effective training time ratio (the time of the steps kept
// over the wall time).
#pragma once

#include <string>
#include <vector>

#include "run/preflight.h"
#include "run/straggler.h"

namespace keel::run {

struct Options {
  std::string config;                 // the keel train config
  std::vector<std::string> sets;      // --set overrides for every attempt
  int ranks = 1;                      // processes (one per GPU, or CPU ranks)
  std::string launcher = "mpirun";    // how the ranks start: mpirun (ranks > 1), or srun (always)
  std::string hosts;                  // mpirun --hostfile (empty: this node)
  int max_restarts = 10;
  double hang_factor = 3.0, min_deadline = 10.0, start_deadline = 300.0;
  StragglerOptions straggler;         // --straggler-factor, --straggler-steps (run/straggler.h)
  PreflightOptions preflight;         // --preflight, --preflight-fraction, --preflight-floor (run/preflight.h)
  bool exclude = true;                // a device failing the pre-flight is taken out (--no-exclude: stop)
  bool exclude_stragglers = false;    // --exclude-stragglers: a straggler's device is taken out too
  double backoff = 1.0, backoff_max = 30.0;
  double grace = 120.0;               // after a stop signal
  double exit_wait = 60.0;            // for an ended attempt's ranks (this host's) to be gone
  int stack_wait_ms = 200;            // a hang: for each of this host's ranks to write its main stack
  double poll = 0.1;                  // seconds between checks
  // How the ranks' heartbeats reach keel run: "files" (keel train --heartbeat: heartbeat_dir),
  // "udp" (--heartbeat-udp: datagrams to a port keel run listens on, tagged by attempt), "both"
  // (each rank's newest of the two counts), "auto": files on one node, both on several (a shared
  // file system can hold a heartbeat file back behind a checkpoint's writes for seconds).
  std::string heartbeats = "auto";
  std::string heartbeat_host;         // the name the ranks send datagrams to (default: this host's; one node: 127.0.0.1)
  std::vector<std::string> inject;    // keel train --inject specs (faults for testing; see run())
  std::string events;                 // events file (default: <output_dir>/run_events.jsonl)
  std::vector<std::string> train_args;  // more keel train flags, as given
};

// Runs the job to its end. Returns the process exit code: 0 when all steps are done (or a stop
// signal ended it cleanly), non-zero after max_restarts faults (one error line saying why).
// Faults injected with `inject` go to the first attempt; a later attempt gets those whose step
// lies beyond the step its predecessor reached (the others have fired).
int run(const Options& o);

// Where the ranks write their heartbeat files (keel train --heartbeat). On one node: a directory
// of the node's memory file system, local_root/keel-run-<this pid> (no journal, no disk: a
// checkpoint being flushed to the run's disk cannot hold a heartbeat back); removed when keel
// run ends. On several nodes, or without a writable local_root: <output_dir>/.heartbeat, which
// every node sees (and the heartbeats also come as datagrams: Options::heartbeats).
std::string heartbeat_dir(const std::string& output_dir, bool multi_node, const std::string& local_root = "/dev/shm");

}  // namespace keel::run

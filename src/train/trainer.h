// The training loop of `keel train` (docs/train.md), the same on every device (the model and
// optimizer are a TrainBackend: CPU or one GPU per rank) and for any number of data-parallel
// ranks (the mesh's data group; the global batch and sample order do not depend on it): micro-batches from the data sampler,
// gradient accumulation, global-norm clipping, AdamW on the scheduled learning rate, the
// router-bias update, logging (console + metrics.jsonl, TensorBoard optional), periodic eval
// on a held-out dataset and full checkpoints that resume bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/dir_lock.h"
#include "common/error.h"
#include "common/faults.h"
#include "common/udp.h"
#include "common/watchdog.h"
#include "data/blend.h"
#include "train/backend.h"
#include "train/heartbeat.h"
#include "train/loss_guard.h"
#include "train/metrics_log.h"
#include "train/model.h"
#include "train/train_checkpoint.h"
#include "train/train_config.h"

namespace keel::train {

// A step whose loss or gradient norm is not finite, or whose loss is a spike (fault.loss_spike_*,
// train/loss_guard.h; the same verdict on every rank): the run stops; nothing was updated, and
// the trainer saves the state before that step when it saves checkpoints.
class NonFiniteStep : public keel::Error {
 public:
  using keel::Error::Error;
};

struct StepStats {
  std::int64_t step = 0;  // 1-based: the number of optimizer steps done after this one
  double loss = 0, ce = 0, aux = 0, z = 0, lr = 0, grad_norm = 0;
  double load_min = 0, load_max = 0;  // expert load / mean load, over every MoE layer
  // The routing, as every throughput figure states it: the largest share of a layer's routed
  // slots one class took, and the largest share the skip class took (0 without one), over the
  // MoE layers.
  double busiest_share = 0, skip_share = 0;
  // The same per MoE layer: layer_busiest[i] the busiest class's share of layer i's routed slots
  // (skip included), layer_skip[i] the skip class's (0 without one).
  std::vector<double> layer_busiest, layer_skip;
  // With router.log_counts: every MoE layer's tokens per router class this step (the skip class
  // last), summed over micro-batches and data-parallel ranks.
  std::vector<std::vector<std::int64_t>> routing_counts;
};

class Trainer {
 public:
  // mesh: the run's process groups (parallel/mesh.h; one process by default). The device is
  // config.device (`auto`: CUDA when a GPU is visible; keel train resolves it alike on every
  // rank before it builds the Trainer). quiet: no console output (tests); the JSONL log is
  // always written to output_dir.
  Trainer(TrainConfig config, const parallel::Mesh& mesh = {}, bool quiet = false);
  ~Trainer();

  // The constructor takes the run's directory locks (common/dir_lock.h): output_dir, and
  // checkpoint.dir when it exists (run() takes it when it creates it). Another process holding
  // one is a UsageError naming it, on every rank (rank 0 locks and tells the others).

  // Loads a keel ckpt checkpoint: a checkpoint.dir root (its newest committed step: `latest`, or a
  // newer committed step when `latest` lags behind it, which is said), or one step directory.
  // This config's own checkpoint.dir or output_dir holding no committed checkpoint yet (a run that
  // stopped before its first save) continues as a restart from step 0, said and logged into the
  // same metrics.jsonl. Prints how this config differs from the checkpoint's.
  void resume(const std::string& path);
  // Sets the weights (and router biases, when present) from a keel checkpoint, with fresh
  // optimizer state: what config.init_from does, which run() calls when the run starts at step
  // 0 without resume(). A resumed run takes everything from its checkpoint instead.
  void init_from_weights(const std::string& path);
  // Trains until `until` optimizer steps are done (-1: config.steps). Saves checkpoints at
  // checkpoint.interval, at the end of training and, with checkpoint_at_stop, where `until`
  // stops it early (`keel train --stop-after`). Before any work the first call refuses to
  // write where it would clobber another run: a checkpoint.dir with checkpoints (for a resumed
  // run: other than its own, up to its step), an output_dir with another run's metrics.jsonl.
  // Returns the stats of the steps it ran.
  std::vector<StepStats> run(std::int64_t until = -1, bool checkpoint_at_stop = false);
  // Mean CE over eval.batches micro-batches of the held-out dataset (always the same ones).
  double evaluate();
  // Starts an asynchronous save of the current step into checkpoint.dir (train_checkpoint.h):
  // training pays only for staging the state in host memory; the write overlaps the next steps
  // and commits at the next save or finish_checkpoint(). Nothing when this step is saved already.
  void save_checkpoint();
  // Commits the save in flight, if any, and prints what was saved.
  void finish_checkpoint();
  // The step directory a checkpoint of `step` is committed to.
  std::string checkpoint_path(std::int64_t step) const;

  // Turns a hang into an error: run() re-arms `dog` for `seconds` before each step, eval and
  // checkpoint phase, so a rank that stops making progress (its own hang, or a peer's in a
  // collective) exits with one line naming the step (common/watchdog.h). Not owned.
  void watch_progress(Watchdog* dog, double seconds) { dog_ = dog, dog_seconds_ = seconds; }
  // Fault injection (common/faults.h, keel train --inject): run() asks the plan at the start of
  // every step, before any of its work (kill, exit, hang, slow on this world rank),
  // train_step() whether the step's loss is to be NaN or spike (then on every rank of this rank's
  // tensor group, so that the ranks stop alike through the non-finite-loss or spike check), and
  // the checkpointer whether this rank's write of a step's checkpoint is to fail (diskfull).
  void set_faults(FaultPlan plan) { faults_ = std::move(plan); }
  // keel train --heartbeat DIR: every rank writes DIR/rank-<world rank>.json (through a .tmp
  // file and a rename) after start-up (phase "start"), after every step (phase "step", after
  // that step's checkpoint save) and at run()'s end (phase "done"): {"rank", "step", "time"
  // (unix seconds), "step_seconds", "phase", "host", "pid", "world"}. DIR is created when
  // missing; a failed write is one warning line, never an error. A thread writes the files
  // (train/heartbeat.h): the step loop never waits for the file system; run() returns after
  // its "done" heartbeat is written.
  // On GPUs the device canary (TrainBackend::device_canary_seconds) is made here, before the
  // first step.
  void heartbeat_to(std::string dir) {
    heartbeat_dir_ = std::move(dir);
    backend_->device_canary_seconds(0);
  }
  // keel train --heartbeat-udp HOST:PORT/TAG: every heartbeat also as one datagram through
  // `sender`, sent from the step loop itself (non-blocking, common/udp.h), the JSON with "tag":
  // TAG (keel run tells its attempts apart by it).
  void heartbeat_udp_to(std::unique_ptr<UdpSender> sender, std::string tag) {
    heartbeat_udp_ = std::move(sender);
    heartbeat_tag_ = std::move(tag);
    backend_->device_canary_seconds(0);
  }
  // keel train --skip-step S: just before step S runs, the loader skips one step's micro-batches
  // (the data of step S), and step S trains on the data that follows. Steps this run does not
  // execute (at or before the step it resumed from) skip nothing.
  void skip_data_of(std::vector<std::int64_t> steps) { skip_steps_ = std::move(steps); }
  // A stop request (keel train: the first SIGINT / SIGTERM): `requested` returns a signal number
  // or 0. run() asks it at every step boundary and combines the answers over the world, so every
  // rank stops at the same step when any rank was asked; it then saves a checkpoint of that step
  // (when the run saves checkpoints) and returns. stopped_by() is that signal afterwards.
  void stop_when(std::function<int()> requested) { stop_requested_ = std::move(requested); }
  int stopped_by() const { return stopped_by_; }

  std::int64_t step() const { return step_; }
  TrainBackend& backend() { return *backend_; }
  const TrainConfig& config() const { return cfg_; }

 private:
  StepStats train_step();
  // Creates the checkpointer and its staging buffers (collective over the data group).
  void make_checkpointer();
  // The checks of run() on checkpoint.dir (see run()); one error line naming the directory.
  void check_checkpoint_dir() const;
  // Every token id of the samples evaluate() reads fits the vocabulary (UsageError otherwise).
  void check_eval_tokens() const;
  std::string parallel_text() const;
  void log_step(const StepStats& s, double seconds, std::int64_t tokens);
  // Commits the save in flight once every rank's background writes are done (at a step boundary).
  void commit_when_written();
  // Re-arms the watchdog, if any, for `what`.
  void progress(const std::string& what);
  // Takes output_dir's lock and checkpoint.dir's (when it exists, or creating it) on rank 0; the
  // refusal, if any, is one UsageError on every rank (collective over the world).
  void lock_run_dirs(bool create_checkpoint_dir);
  // The stop request of any rank, the same on every rank (collective over the world).
  int poll_stop();
  // Writes this rank's heartbeat file, if any (heartbeat_to()).
  void heartbeat(const char* phase, double step_seconds, double wait_seconds = 0, double device_seconds = 0);

  TrainConfig cfg_;
  parallel::Mesh mesh_;
  bool quiet_;
  std::unique_ptr<TrainBackend> backend_;
  std::unique_ptr<TrainCheckpointer> ckpt_;
  std::unique_ptr<data::DataPipeline> data_;
  std::unique_ptr<data::BatchLoader> loader_;
  std::unique_ptr<data::IndexedDataset> eval_ds_;
  std::unique_ptr<data::SequenceSampler> eval_sampler_;
  std::unique_ptr<MetricsLog> log_;
  std::int64_t step_ = 0;
  int local_accum_ = 1;  // micro-batches per step on this rank: grad_accum / data-parallel degree
  bool resumed_ = false;
  bool restarted_ = false;       // --resume of this run's own directory with no checkpoint yet: from step 0
  std::shared_ptr<DirLock> output_lock_, checkpoint_lock_;
  std::function<int()> stop_requested_;
  int stopped_by_ = 0;
  std::string resumed_from_;     // the step directory resume() read
  bool started_ = false;         // run() has done its start-up checks
  bool earlier_metrics_ = false;  // output_dir held a non-empty metrics.jsonl before this run
  std::int64_t saved_step_ = -1;  // the step of the last save this process started
  bool initialized_ = false;  // init_from_weights() done
  Watchdog* dog_ = nullptr;
  double dog_seconds_ = 0;
  FaultPlan faults_;
  std::vector<std::int64_t> skip_steps_;
  LossGuard loss_guard_;  // fault.loss_spike_*; its window is saved with every checkpoint while on
  std::string heartbeat_dir_;
  std::unique_ptr<UdpSender> heartbeat_udp_;  // --heartbeat-udp
  std::string heartbeat_tag_;
  bool beating() const { return !heartbeat_dir_.empty() || heartbeat_udp_; }
  bool heartbeat_started_ = false;  // the "start" heartbeat is written
  bool heartbeat_warned_ = false;
  std::unique_ptr<HeartbeatWriter> heartbeat_writer_;  // made by the first heartbeat
  double last_step_seconds_ = 0;  // the step_seconds of the last heartbeat
  HeartbeatRecord beat_;  // the last heartbeat (its identity fields set by the first)
  std::vector<std::int32_t> targets_;
  std::vector<std::uint32_t> inputs_;
};

}  // namespace keel::train

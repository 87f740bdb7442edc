// The YAML training config of `keel train` (docs/train.md lists every key). Unknown keys are
// rejected naming the key and the file; `--set key.sub=value` overrides apply before parsing.
// Relative paths (model file, datasets, output_dir, checkpoint dir) are relative to the
// working directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/blend.h"
#include "model/config.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "parallel/zero1_buckets.h"
#include "train/model.h"
#include "train/param_rules.h"

namespace keel::train {

// `kernels:` of the train config: how the ops use the machine. None changes a result (the MoE
// lanes run experts that write disjoint rows; the CPU ops split work statically; the profile
// only records events), only speed and memory.
struct KernelOptions {
  int moe_lanes = 4;    // `kernels.moe_lanes`: side streams the CUDA experts run on (1: one after another)
  int cpu_threads = 0;  // `kernels.cpu_threads`: threads of the CPU reference ops (0: every core)
  bool profile = false;  // `kernels.profile`: time the GPU step phase by phase (train/step_profile.h)
};

struct TrainConfig {
  std::string path;                 // the config file (for messages)
  model::ModelConfig model;         // `model:` a model YAML path, or the model keys inline; left out
                                    // with init_from: the model that checkpoint records
  std::string model_source;         // the path, or "inline"
  ModelOptions model_options;       // recompute, router.*, ce_chunk, seed (micro_batch/seq from below)
  data::DataConfig data;            // `data:` a keel data config (phases optional: one phase of equal weights)
  std::string eval_prefix;          // `eval.prefix`: held-out dataset ("" = no eval)
  std::int64_t eval_interval = 0;   // `eval.interval` steps (0: only at the end when a prefix is given)
  std::int64_t eval_batches = 4;    // `eval.batches` micro-batches per eval
  optim::AdamWConfig adamw;         // `optimizer.{beta1, beta2, eps, weight_decay}`
  double clip = 1.0;                // `optimizer.clip` (<= 0: no clipping)
  MuonTrainOptions muon;            // `optimizer.muon.*`: Muon on the weight matrices (off by default)
  optim::LrSchedule schedule;       // `optimizer.lr`, `optimizer.min_lr`, `schedule.*`; total = steps
  int micro_batch = 1;              // `batch.micro_batch` (sequences per micro-batch)
  int grad_accum = 1;               // `batch.grad_accum`: micro-batches per step over all data-parallel ranks
  int parallel_data = 0;            // `parallel.data`: data-parallel degree (0: every rank of the launch)
  int parallel_tensor = 1;          // `parallel.tensor`: tensor-parallel degree (Megatron; `parallel.sequence`
                                    // is model_options.sequence_parallel)
  int parallel_context = 1;         // `parallel.context`: context-parallel degree (each sequence's tokens
                                    // split over it: parallel/context_parallel.h)
  int parallel_tsp = 1;             // `parallel.tsp`: TSP degree (weights and tokens split over one axis:
                                    // parallel/tsp.h)
  int parallel_expert = 1;          // `parallel.expert`: expert-parallel degree, dividing the data-parallel
                                    // ranks and the experts
  bool context_mode_auto = false;   // `parallel.context_mode: auto`: model_options.context_mode was chosen
                                    // by parallel::auto_context_mode
  // `parallel.grad_reduce` (fp32 or bf16: parallel/data_parallel_comm.h) and `parallel.zero1.*`
  // (the GPU ZeRO-1 step's switches: parallel/zero1_buckets.h)
  parallel::DataParallelOptions data_parallel;
  KernelOptions kernels;            // `kernels.*`
  std::int64_t steps = 0;
  std::int64_t log_interval = 1;
  std::string output_dir = "out/train";
  std::string checkpoint_dir;       // `checkpoint.dir` (default: output_dir)
  std::int64_t checkpoint_interval = 0;  // `checkpoint.interval` (0: only at the end)
  bool checkpoint_final = true;     // `checkpoint.final`: save when training ends (off for benchmarks)
  int checkpoint_keep_last = 0;     // `checkpoint.keep_last`: newest K kept (0: all)
  int checkpoint_keep_every = 0;    // `checkpoint.keep_every`: also every step divisible by M
  int checkpoint_flush_behind_mib = 256;  // `checkpoint.flush_behind_mib`: write-behind window (0: off)
  double loss_spike_sigma = 0;      // `fault.loss_spike_sigma` k: a loss above mean + k x std of the last
                                    // `fault.loss_spike_window` steps' stops the run (0: off; train/loss_guard.h)
  int loss_spike_window = 50;       // `fault.loss_spike_window` W (>= 5)
  bool tensorboard = false;
  bool log_routing_counts = false;  // `router.log_counts`: every MoE layer's per-class token counts of each
                                    // logged step in metrics.jsonl ("routing_counts")
  double peak_flops = 0;            // `mfu_peak_flops`: FLOP/s that MFU is measured against (0: the
                                    // GPU's dense bf16 peak from its hardware profile; 1e11 on CPUs)
  std::string device = "auto";      // `device`: auto (cuda when a GPU is visible), cpu or cuda
  std::uint64_t seed = 1234;        // model initialization
  std::string init_from;            // `init_from`: start from these weights (a keel checkpoint, e.g. imported
                                    // released weights) with fresh optimizer state at step 0; "" = random init
  std::string text;                 // the effective config (YAML, overrides applied) for the log
};

// Loads `path`, applies overrides ("a.b=value", value parsed as YAML) and validates.
// Every error is one keel::UsageError line naming the file and the key.
TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides = {});
TrainConfig parse_train_config(const std::string& yaml_text, const std::string& what,
                               const std::vector<std::string>& overrides = {});

}  // namespace keel::train

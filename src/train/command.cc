#include "train/command.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "train/trainer.h"

namespace keel::train {

void add_command(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> sets;
    std::string resume;
    std::int64_t until = -1;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("train", "Train a decoder-only MoE transformer from a YAML training config (one GPU, or the CPU)");
  cmd->add_option("config", args->config, "Training config (YAML)")->required();
  cmd->add_option("--set", args->sets, "Override a config key: --set optimizer.lr=1e-3 (repeatable)");
  cmd->add_option("--resume", args->resume, "Continue from a checkpoint: a checkpoint.dir root (its latest) or one step directory");
  cmd->add_option("--stop-after", args->until,
                  "Stop after this many optimizer steps in total (the schedule still spans `steps`); saves a checkpoint");
  cmd->callback([args] {
    const TrainConfig cfg = load_train_config(args->config, args->sets);
    Trainer t(cfg);
    if (!args->resume.empty()) t.resume(args->resume);
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t start = t.step();
    const auto stats = t.run(args->until);
    if (args->until >= 0 && t.step() < cfg.steps) {
      t.save_checkpoint();
      t.finish_checkpoint();
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!stats.empty())
      std::printf("done: steps %lld -> %lld in %.1f s, loss %.4f -> %.4f\n", static_cast<long long>(start),
                  static_cast<long long>(t.step()), sec, stats.front().loss, stats.back().loss);
    else
      std::printf("done: nothing to do (step %lld of %lld)\n", static_cast<long long>(t.step()),
                  static_cast<long long>(cfg.steps));
  });
}

}  // namespace keel::train

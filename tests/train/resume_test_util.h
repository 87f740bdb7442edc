// The resume check shared by the trainer tests: a run of cfg.steps uninterrupted (into
// cfg.output_dir) against the same run stopped after `stop_at` steps, checkpointed into
// `resumed_dir` and finished by a fresh trainer. Losses, gradient norms, parameters, optimizer
// moments and router biases must be equal bit for bit; the loss must fall.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <vector>

#include "train/trainer.h"

namespace keel::train::fixtures {

// Returns the uninterrupted run's stats.
inline std::vector<StepStats> expect_resume_bit_exact(TrainConfig cfg, const std::filesystem::path& resumed_dir,
                                                      std::int64_t stop_at) {
  Trainer a(cfg, parallel::Mesh(), true);
  const auto sa = a.run();
  EXPECT_EQ(sa.size(), static_cast<std::size_t>(cfg.steps));
  if (sa.empty()) return sa;
  EXPECT_LT(sa.back().ce, sa.front().ce);
  cfg.output_dir = cfg.checkpoint_dir = resumed_dir.string();
  std::vector<StepStats> sb;
  {
    Trainer b(cfg, parallel::Mesh(), true);
    sb = b.run(stop_at);
    b.save_checkpoint();
    b.finish_checkpoint();
  }
  Trainer c(cfg, parallel::Mesh(), true);
  c.resume(resumed_dir.string());
  EXPECT_EQ(c.step(), stop_at);
  const auto sc = c.run();
  sb.insert(sb.end(), sc.begin(), sc.end());
  EXPECT_EQ(sb.size(), sa.size());
  for (std::size_t i = 0; i < sa.size() && i < sb.size(); ++i) {
    EXPECT_EQ(sa[i].loss, sb[i].loss) << "step " << i + 1;
    EXPECT_EQ(sa[i].grad_norm, sb[i].grad_norm) << "step " << i + 1;
  }
  const TrainState x = a.backend().state(), y = c.backend().state();
  EXPECT_EQ(0, std::memcmp(x.params.data(), y.params.data(), x.params.size() * sizeof(float)));
  EXPECT_EQ(x.adam_m, y.adam_m);
  EXPECT_EQ(x.adam_v, y.adam_v);
  EXPECT_EQ(x.router_bias, y.router_bias);
  EXPECT_EQ(x.router_balance.m, y.router_balance.m);
  EXPECT_EQ(x.router_balance.v, y.router_balance.v);
  EXPECT_EQ(x.router_balance.updates, y.router_balance.updates);
  return sa;
}

}  // namespace keel::train::fixtures

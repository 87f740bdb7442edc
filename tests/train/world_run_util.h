// What the context-parallel and TSP training tests share: their config (the tests' tiny MoE on
// a dataset made once, 20 steps of 24-token sequences: 2C chunks for 2, 3 and 4 ranks) and the
// per-step comparison of a multi-rank run with the one-rank run of the same global batch.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace keel::train::fixtures {

// Rank 0 makes the dataset in `dir` (once); every rank parses the config, named `name`.
inline TrainConfig world_config(const std::filesystem::path& dir, const std::filesystem::path& out,
                                const std::vector<std::string>& extra, const std::string& optimizer_extra,
                                const std::string& name) {
  if (test::world_rank() == 0 && !std::filesystem::exists(dir / "d.idx")) make_dataset(dir, "d");
  MPI_Barrier(MPI_COMM_WORLD);
  // 24 tokens: 2C chunks for C = 2, 3 and 4 (CCA reads 2 tokens before each chunk)
  std::vector<std::string> sets = {"steps=20", "checkpoint.final=false", "data.seq_length=24"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_train_config(train_config_text((dir / "d").string(), out, optimizer_extra), name, sets);
}

// 20 steps each, every one within 1e-5 relative (loss, aux loss), 1e-4 (gradient norm), with the
// same routing of the whole batch (the ranks' counts summed).
inline void expect_same_steps(const std::vector<StepStats>& got, const std::vector<StepStats>& want,
                              const std::string& tag) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(got.size(), 20u);
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].loss, want[i].loss, 1e-5 * std::fabs(want[i].loss)) << tag << " step " << i + 1;
    EXPECT_NEAR(got[i].aux, want[i].aux, 1e-5 * std::fabs(want[i].aux) + 1e-9) << tag << " step " << i + 1;
    EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, 1e-4 * want[i].grad_norm) << tag << " step " << i + 1;
    EXPECT_EQ(got[i].layer_busiest, want[i].layer_busiest) << tag << " step " << i + 1;
  }
}

}  // namespace keel::train::fixtures

// train::config_changes: the resume line's list of what differs between a checkpoint's saved
// config and the run's.
#include "train/config_changes.h"

#include <gtest/gtest.h>

namespace keel::train {
namespace {

TEST(ConfigChanges, NamesChangedAddedAndRemovedKeysUnderThePrefix) {
  const std::string saved = "optimizer:\n  lr: 3.0e-3\n  clip: 1.0\nsteps: 10\nmodel:\n  layers: [a, b]\n";
  const std::string now = "optimizer:\n  lr: 1.0e-3\n  beta1: 0.9\nsteps: 10\nmodel:\n  layers: [a, c]\n";
  EXPECT_EQ(config_changes(saved, now, ""),
            "model.layers[1] b -> c, optimizer.beta1 (unset) -> 0.9, optimizer.clip 1.0 -> (unset), "
            "optimizer.lr 3.0e-3 -> 1.0e-3");
  EXPECT_EQ(config_changes(saved, now, "model."), "model.layers[1] b -> c");
  EXPECT_EQ(config_changes(saved, saved, ""), "");
}

TEST(ConfigChanges, NumbersCompareByValueAndBadTextIsNoChange) {
  EXPECT_EQ(config_changes("lr: 3.0e-3\n", "lr: 0.003\n", ""), "");
  EXPECT_EQ(config_changes("lr: 3.0e-3\n", "lr: 0.0031\n", ""), "lr 3.0e-3 -> 0.0031");
  EXPECT_EQ(config_changes("lr: [1, 2\n", "lr: 1\n", ""), "");
}

TEST(ConfigChanges, NoRecordedModelIsNoChange) {
  EXPECT_EQ(recorded_model_changes("/nonexistent/keel/checkpoint", model::ModelConfig{}), "");
}

}  // namespace
}  // namespace keel::train

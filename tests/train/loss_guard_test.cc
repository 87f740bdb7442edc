// The loss-spike guard (train/loss_guard.h): when it calls a loss a spike, its window, its
// message; the fault.loss_spike_* keys; and in the Trainer: a spike stops the run before the
// update with the state of the step before saved (with the window), and a run resumed from
// that checkpoint detects the same spike at the same step.
#include "train/loss_guard.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/faults.h"
#include "train/trainer.h"

#include "train_test_util.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;

TEST(LossGuard, OffNeverCallsASpike) {
  LossGuard g;  // off
  EXPECT_FALSE(g.enabled());
  for (int i = 0; i < 100; ++i) g.record(1.0);
  EXPECT_FALSE(g.is_spike(1e30));
  LossGuard zero(0.0, 5);
  for (int i = 0; i < 10; ++i) zero.record(1.0 + 0.01 * i);
  EXPECT_FALSE(zero.is_spike(1e30));
}

TEST(LossGuard, WaitsForAFullWindowThenComparesWithMeanPlusKStd) {
  LossGuard g(3.0, 5);
  EXPECT_TRUE(g.enabled());
  const std::vector<double> xs = {4.0, 6.0, 4.0, 6.0};
  for (double x : xs) {
    EXPECT_FALSE(g.is_spike(1e9)) << "fewer than W losses";
    g.record(x);
  }
  EXPECT_FALSE(g.is_spike(1e9)) << "4 of 5";
  g.record(5.0);  // window 4 6 4 6 5: mean 5, population std sqrt(0.8)
  EXPECT_DOUBLE_EQ(g.mean(), 5.0);
  EXPECT_DOUBLE_EQ(g.stddev(), std::sqrt(0.8));
  const double edge = 5.0 + 3.0 * std::sqrt(0.8);
  EXPECT_FALSE(g.is_spike(edge)) << "at the threshold: not above it";
  EXPECT_TRUE(g.is_spike(std::nextafter(edge, 1e9)));
  EXPECT_FALSE(g.is_spike(0.0)) << "a drop is no spike";
  EXPECT_EQ(g.spike_message(12, 100.0),
            "step 12: loss 100 is a spike (> mean 5 + 3 x std 0.894427 over the last 5 steps)");
}

TEST(LossGuard, WindowSlidesAndRestoresItsNewestW) {
  LossGuard g(2.0, 5);
  for (int i = 1; i <= 8; ++i) g.record(i);
  EXPECT_EQ(g.window(), (std::vector<double>{4, 5, 6, 7, 8}));
  // a spike is not recorded by the trainer: the window stays as it was
  EXPECT_TRUE(g.is_spike(100));
  EXPECT_EQ(g.window(), (std::vector<double>{4, 5, 6, 7, 8}));
  LossGuard r(2.0, 3);  // a smaller window than the one saved: its newest 3
  r.restore(g.window());
  EXPECT_EQ(r.window(), (std::vector<double>{6, 7, 8}));
  LossGuard same(2.0, 5);
  same.restore(g.window());
  EXPECT_EQ(same.is_spike(11.0), g.is_spike(11.0));
  EXPECT_EQ(same.is_spike(9.5), g.is_spike(9.5));
}

TEST(LossGuard, ConfigKeysDefaultsAndErrors) {
  const auto dir = fixtures::temp_dir("loss_guard", "config");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string text = fixtures::train_config_text(prefix, dir / "out");
  const TrainConfig d = parse_train_config(text, "t.yaml");
  EXPECT_EQ(d.loss_spike_sigma, 0.0);
  EXPECT_EQ(d.loss_spike_window, 50);
  const TrainConfig c = parse_train_config(text, "t.yaml", {"fault.loss_spike_sigma=6", "fault.loss_spike_window=5"});
  EXPECT_EQ(c.loss_spike_sigma, 6.0);
  EXPECT_EQ(c.loss_spike_window, 5);
  fixtures::expect_usage_error(text, {"fault.loss_spike_sigma=-1"},
                               "key 'fault.loss_spike_sigma' (from --set): must be >= 0 (0: off)");
  fixtures::expect_usage_error(text, {"fault.loss_spike_sigma=.inf"}, "key 'fault.loss_spike_sigma'");
  fixtures::expect_usage_error(text, {"fault.loss_spike_sigma=high"},
                               "key 'fault.loss_spike_sigma' (from --set): must be a number, got 'high'");
  fixtures::expect_usage_error(text, {"fault.loss_spike_window=4"},
                               "key 'fault.loss_spike_window' (from --set): must be >= 5 (steps)");
  fixtures::expect_usage_error(text, {"fault.loss_spike_windows=8"}, "unknown key 'fault.loss_spike_windows'");
}

// The metrics.jsonl losses of `out`, by step.
std::map<std::int64_t, double> logged_losses(const fs::path& out) {
  std::map<std::int64_t, double> m;
  std::ifstream f(out / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && j.contains("step")) m[j["step"].get<std::int64_t>()] = j["loss"].get<double>();
  }
  return m;
}

TEST(LossGuard, TrainerStopsBeforeTheUpdateAndAResumeDetectsTheSameSpike) {
  const auto dir = fixtures::temp_dir("loss_guard", "trainer");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::vector<std::string> sets = {"fault.loss_spike_sigma=10", "fault.loss_spike_window=5", "log_interval=1",
                                         "checkpoint.interval=3"};
  const TrainConfig c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", sets);
  std::string first;
  {
    Trainer t(c, parallel::Mesh(), true);
    t.set_faults(parse_faults("spike@9"));
    try {
      t.run();
      FAIL() << "no spike detected";
    } catch (const NonFiniteStep& e) {
      first = e.what();
    }
    EXPECT_EQ(t.step(), 8) << "stopped before step 9's update";
  }
  EXPECT_EQ(first.rfind("step 9: loss ", 0), 0u) << first;
  EXPECT_NE(first.find(" is a spike (> mean "), std::string::npos) << first;
  EXPECT_NE(first.find(" + 10 x std "), std::string::npos) << first;
  EXPECT_NE(first.find(" over the last 5 steps)"), std::string::npos) << first;
  // the state of step 8 saved, with the window: the losses of steps 4-8 as logged
  const fs::path ck = dir / "a" / "step_00000008" / "metadata.json";
  ASSERT_TRUE(fs::exists(ck));
  std::ifstream f(ck);
  const nlohmann::json meta = nlohmann::json::parse(f);
  const auto logged = logged_losses(dir / "a");
  ASSERT_TRUE(meta["state"].contains("loss_window")) << meta["state"].dump();
  std::vector<double> want;
  for (std::int64_t s = 4; s <= 8; ++s) want.push_back(logged.at(s));
  EXPECT_EQ(meta["state"]["loss_window"].get<std::vector<double>>(), want);
  EXPECT_FALSE(logged.contains(9));

  // resumed from step 6 (saved at the interval) into another directory: the window comes back
  // and the spike at step 9 is seen the same way, with the same numbers
  {
    const TrainConfig b = parse_train_config(fixtures::train_config_text(prefix, dir / "b"), "t.yaml", sets);
    Trainer t(b, parallel::Mesh(), true);
    t.resume((dir / "a" / "step_00000006").string());
    t.set_faults(parse_faults("spike@9"));
    try {
      t.run(9);
      FAIL() << "the resumed run saw no spike";
    } catch (const NonFiniteStep& e) {
      EXPECT_EQ(std::string(e.what()), first);
    }
  }
  // the checkpoint of step 8 resumed with a skip of step 9 trains on
  {
    Trainer t(c, parallel::Mesh(), true);
    t.resume((dir / "a").string());
    t.skip_data_of({9});
    const auto stats = t.run();
    EXPECT_EQ(t.step(), 12);
    ASSERT_FALSE(stats.empty());
    EXPECT_EQ(stats.front().step, 9);
  }
}

TEST(LossGuard, WithoutTheGuardAnInjectedSpikeTrainsOn) {
  const auto dir = fixtures::temp_dir("loss_guard", "off");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const TrainConfig c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml",
                                           {"log_interval=1", "checkpoint.final=false"});
  Trainer t(c, parallel::Mesh(), true);
  t.set_faults(parse_faults("spike@9"));
  const auto stats = t.run();
  ASSERT_EQ(stats.size(), 12u);
  EXPECT_GT(stats[8].loss, 20 * stats[7].loss) << "the injected factor shows in the step's loss";
}

}  // namespace
}  // namespace keel::train

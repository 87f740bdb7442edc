// keel::train::Trainer and the train config: bit-exact resume, clear errors for bad configs,
// missing or truncated datasets and a NaN loss.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/indexed_dataset.h"
#include "train/trainer.h"

#include "resume_test_util.h"
#include "train_test_util.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;


TEST(TrainConfig, ParsesAndOverrides) {
  const auto dir = fixtures::temp_dir("train_test", "cfg");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml",
                                    {"optimizer.lr=0.5", "batch.grad_accum=3", "recompute=full", "schedule.kind=wsd"});
  EXPECT_DOUBLE_EQ(c.schedule.peak_lr, 0.5);
  EXPECT_EQ(c.grad_accum, 3);
  EXPECT_EQ(c.model_options.recompute, Recompute::kFull);
  EXPECT_EQ(c.schedule.kind, optim::ScheduleKind::kWsd);
  EXPECT_EQ(c.model.experts, 4);
  EXPECT_EQ(c.data.seq_length, 16u);
  EXPECT_EQ(c.data.phases.size(), 1u);
}

using fixtures::expect_usage_error;

TEST(TrainConfig, BadConfigsGiveClearErrors) {
  const auto dir = fixtures::temp_dir("train_test", "badcfg");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  expect_usage_error(good + "learning_rate: 3\n", {}, "bad.yaml: unknown key 'learning_rate' (line");
  expect_usage_error(good, {"optimizer.lrr=1"}, "unknown key 'optimizer.lrr' (from --set)");
  expect_usage_error(good, {"steps=0"}, "key 'steps' (from --set): must be >= 1");
  expect_usage_error(good, {"recompute=some"}, "unknown mode 'some'");
  expect_usage_error(good, {"model.attention=cca"}, "bad.yaml: model:");
  expect_usage_error(good, {"model.heads=3"}, "bad.yaml: model:");
  expect_usage_error(good, {"batch.micro_batch=x"}, "key 'batch.micro_batch' (from --set): must be an integer");
  expect_usage_error(good, {"nokey"}, "expected key.sub=value");
  expect_usage_error("steps: 3\n", {}, "missing key 'model'");
}

TEST(TrainConfig, RejectsLinearAttentionModelAtBuild) {
  const auto dir = fixtures::temp_dir("train_test", "linear");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml");
  c.model.attention = model::AttentionKind::kLinear;
  try {
    Trainer t(c, ParallelContext::single(), true);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("supports mha, gqa and cca"), std::string::npos) << e.what();
  }
}

TEST(Trainer, MissingAndTruncatedDataset) {
  const auto dir = fixtures::temp_dir("train_test", "trunc");
  const auto prefix = fixtures::make_dataset(dir, "d");
  {
    const auto c = parse_train_config(fixtures::train_config_text((dir / "nope").string(), dir / "out"), "t.yaml");
    try {
      Trainer t(c, ParallelContext::single(), true);
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos) << e.what();
    }
  }
  fs::resize_file(prefix + ".bin", fs::file_size(prefix + ".bin") - 10);
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml");
  try {
    Trainer t(c, ParallelContext::single(), true);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("d.bin"), std::string::npos) << e.what();
  }
}

TEST(Trainer, NanLossStopsNamingTheStep) {
  const auto dir = fixtures::temp_dir("train_test", "nan");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml");
  Trainer t(c, ParallelContext::single(), true);
  t.run(3);
  {
    // poison one final-norm weight through the backend's state, as a bad update would
    TrainState st = t.backend().state();
    for (const auto& p : t.backend().layout().params)
      if (p.name == "final_norm.weight") st.params[static_cast<std::size_t>(p.offset)] = std::nanf("");
    t.backend().set_state(st);
  }
  try {
    t.run();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("step 4: loss is NaN (ce NaN", 0), 0u) << e.what();
  }
}

TEST(Trainer, ResumeIsBitExact) {
  const auto dir = fixtures::temp_dir("train_test", "resume");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", {"eval.prefix=" + prefix, "eval.interval=5"});
  // uninterrupted into a/, and stopped after 5 steps into b/ then resumed by a fresh trainer
  ASSERT_EQ(fixtures::expect_resume_bit_exact(cfg, dir / "b", 5).size(), 12u);
  EXPECT_TRUE(fs::exists(dir / "a" / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(dir / "a" / "step_00000012" / "metadata.json"));
  // a truncated data file is refused clearly
  const auto ck = dir / "b" / "step_00000005";
  fs::path data;
  for (const auto& e : fs::directory_iterator(ck))
    if (e.path().extension() == ".bin" && fs::file_size(e.path()) > 4) data = e.path();
  ASSERT_FALSE(data.empty());
  fs::resize_file(data, fs::file_size(data) - 4);
  Trainer d(cfg, ParallelContext::single(), true);
  try {
    d.resume(ck.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST(Trainer, GradAccumMatchesLargerMicroBatch) {
  // 2 micro-batches of 2 rows == 1 micro-batch of 4 rows (same samples) up to fp32 rounding.
  const auto dir = fixtures::temp_dir("train_test", "accum");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto c1 = parse_train_config(fixtures::train_config_text(prefix, dir / "o1"), "t.yaml",
                               {"steps=1", "schedule.warmup_steps=0", "router.aux_loss_weight=0", "router.z_loss_weight=0"});
  auto c2 = parse_train_config(fixtures::train_config_text(prefix, dir / "o2"), "t.yaml",
                               {"steps=1", "schedule.warmup_steps=0", "batch.micro_batch=4", "batch.grad_accum=1", "router.aux_loss_weight=0",
                                "router.z_loss_weight=0"});
  Trainer a(c1, ParallelContext::single(), true), b(c2, ParallelContext::single(), true);
  const auto sa = a.run(), sb = b.run();
  EXPECT_NEAR(sa[0].loss, sb[0].loss, 1e-5);
  EXPECT_NEAR(sa[0].grad_norm, sb[0].grad_norm, 1e-4 * sb[0].grad_norm);
}

TEST(Trainer, InitFromStartsFreshOptimizerOnTheCheckpointsWeights) {
  const auto dir = fixtures::temp_dir("train_test", "init_from");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto src_cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "src"), "t.yaml", {"steps=3"});
  Trainer src(src_cfg, ParallelContext::single(), true);
  src.run();
  src.finish_checkpoint();
  const TrainState trained = src.backend().state();

  auto cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "dst"), "t.yaml",
                                {"steps=2", "init_from=" + (dir / "src").string()});
  EXPECT_EQ(cfg.init_from, (dir / "src").string());
  Trainer t(cfg, ParallelContext::single(), true);
  t.run(0);  // no steps: only the initialization
  EXPECT_EQ(t.step(), 0);
  const TrainState got = t.backend().state();
  ASSERT_EQ(got.params.size(), trained.params.size());
  EXPECT_EQ(std::memcmp(got.params.data(), trained.params.data(), got.params.size() * sizeof(float)), 0);
  EXPECT_EQ(got.router_bias, trained.router_bias);
  EXPECT_EQ(got.adamw_step, 0);
  for (float m : got.adam_m) ASSERT_EQ(m, 0.f);
  for (float v : got.adam_v) ASSERT_EQ(v, 0.f);

  // Its first step sees the trained weights: the loss starts where the source run ended, well
  // below a fresh model's.
  auto fresh_cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "fresh"), "t.yaml", {"steps=2"});
  Trainer fresh(fresh_cfg, ParallelContext::single(), true);
  const double fresh_loss = fresh.run(1).front().loss;
  const double init_loss = t.run(1).front().loss;
  EXPECT_LT(init_loss, fresh_loss - 0.1) << "init_from did not carry the trained weights";

  // A resumed run takes its weights from --resume, not init_from.
  Trainer r(cfg, ParallelContext::single(), true);
  r.resume((dir / "src").string());
  r.run(3);  // nothing left: the source already did 3 steps (of its schedule's 3)
  EXPECT_EQ(r.step(), 3);
}

TEST(Trainer, InitFromRefusesWhatIsNotTheModelsWeights) {
  const auto dir = fixtures::temp_dir("train_test", "init_from_bad");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto src_cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "src"), "t.yaml", {"steps=2"});
  Trainer(src_cfg, ParallelContext::single(), true).run();
  // not a checkpoint: refused before any work
  auto c1 = parse_train_config(fixtures::train_config_text(prefix, dir / "o1"), "t.yaml",
                               {"init_from=" + (dir / "nothing").string()});
  try {
    Trainer t(c1, ParallelContext::single(), true);
    FAIL() << "accepted a missing init_from";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("init_from " + (dir / "nothing").string() + ": not a keel checkpoint"),
              std::string::npos)
        << e.what();
  }
  // another model's weights: the tensor is named
  auto c2 = parse_train_config(fixtures::train_config_text(prefix, dir / "o2"), "t.yaml",
                               {"init_from=" + (dir / "src").string(), "model.hidden=32"});
  Trainer t(c2, ParallelContext::single(), true);
  try {
    t.run(1);
    FAIL() << "loaded weights of another shape";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("init_from " + (dir / "src").string()), std::string::npos) << what;
    EXPECT_NE(what.find("model/"), std::string::npos) << what;
  }
  EXPECT_EQ(t.step(), 0);
}

}  // namespace
}  // namespace keel::train

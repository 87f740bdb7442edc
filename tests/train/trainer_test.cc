// keel::train::Trainer and the train config: bit-exact resume, clear errors for bad configs,
// missing or truncated datasets and a NaN loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/store.h"
#include "common/fileio.h"
#include "data/indexed_dataset.h"
#include "train/trainer.h"

#include "resume_test_util.h"
#include "train_test_util.h"
#include "../error_message.h"

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
  expect_usage_error(good, {"parallel.grad_reduce=fp16"}, "key 'parallel.grad_reduce' (from --set): must be fp32 or bf16");
  expect_usage_error(good, {"nokey"}, "expected key.sub=value");
  expect_usage_error("steps: 3\n", {}, "missing key 'model'");
}

// Every run-shaping switch is a config key (hashed and compared across ranks at start-up), none
// an environment variable: the GPU ZeRO-1 step's (parallel.zero1.*) and the kernels' (kernels.*).
TEST(TrainConfig, Zero1AndKernelSwitchesAreConfigKeys) {
  const auto dir = fixtures::temp_dir("train_test", "zero1keys");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  TrainConfig c = parse_train_config(good, "t.yaml");
  const parallel::Zero1OverlapOptions& d = c.data_parallel.zero1;
  EXPECT_TRUE(d.enabled);
  EXPECT_TRUE(d.broadcast_bf16);
  EXPECT_TRUE(d.shard_masters);
  EXPECT_TRUE(d.group_reduces);
  EXPECT_TRUE(d.optimizer_stream);
  EXPECT_FALSE(d.profile);
  EXPECT_EQ(d.defer_embedding, -1);
  EXPECT_EQ(d.bucket_floats(), 64 << 20);  // 256 MiB of floats
  EXPECT_EQ(c.data_parallel.grad_reduce, parallel::GradReduceDtype::kFp32);
  EXPECT_EQ(c.kernels.moe_lanes, 4);
  EXPECT_EQ(c.kernels.cpu_threads, 0);
  c = parse_train_config(good, "t.yaml",
                         {"parallel.zero1.overlap=false", "parallel.zero1.bucket_mib=0.5",
                          "parallel.zero1.defer_embedding=true", "parallel.zero1.broadcast_bf16=false",
                          "parallel.zero1.shard_masters=false", "parallel.zero1.group_reduces=false",
                          "parallel.zero1.optimizer_stream=false", "parallel.zero1.profile=true",
                          "parallel.grad_reduce=bf16", "kernels.moe_lanes=1", "kernels.cpu_threads=3"});
  const parallel::Zero1OverlapOptions& o = c.data_parallel.zero1;
  EXPECT_FALSE(o.enabled);
  EXPECT_FALSE(o.broadcast_bf16);
  EXPECT_FALSE(o.shard_masters);
  EXPECT_FALSE(o.group_reduces);
  EXPECT_FALSE(o.optimizer_stream);
  EXPECT_TRUE(o.profile);
  EXPECT_EQ(o.defer_embedding, 1);
  EXPECT_EQ(o.bucket_floats(), 131072);
  EXPECT_EQ(c.data_parallel.grad_reduce, parallel::GradReduceDtype::kBf16);
  EXPECT_EQ(c.kernels.moe_lanes, 1);
  EXPECT_EQ(c.kernels.cpu_threads, 3);
  EXPECT_EQ(parse_train_config(good, "t.yaml", {"parallel.zero1.defer_embedding=false"}).data_parallel.zero1.defer_embedding, 0);
  expect_usage_error(good, {"parallel.zero1.bucket_mib=-1"}, "key 'parallel.zero1.bucket_mib' (from --set): must be a positive");
  expect_usage_error(good, {"parallel.zero1.overlap=maybe"}, "key 'parallel.zero1.overlap' (from --set): must be true or false");
  expect_usage_error(good, {"parallel.zero1.defer_embedding=sometimes"}, "must be auto, true or false");
  expect_usage_error(good, {"parallel.zero1.buckets=1"}, "unknown key 'parallel.zero1.buckets'");
  expect_usage_error(good, {"kernels.moe_lanes=9"}, "key 'kernels.moe_lanes' (from --set): must be 1 to 8");
  expect_usage_error(good, {"kernels.cpu_threads=-2"}, "key 'kernels.cpu_threads' (from --set): must be >= 0");
  expect_usage_error(good, {"kernels.gemm=cublas"}, "unknown key 'kernels.gemm'");
}

TEST(TrainConfig, LinearAttentionModelBuildsOnCpu) {
  const auto dir = fixtures::temp_dir("train_test", "linear");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml");
  c.model.attention = model::AttentionKind::kLinear;
  c.device = "cpu";
  EXPECT_NO_THROW(Trainer(c, parallel::Mesh(), true));
}

// parallel.context_mode: auto (parallel/context_mode.h): the k/v ring for softmax / CCA layers
// under context parallelism alone, the all-gather with linear layers (LASP-2) or with a tensor
// or TSP axis; a word it does not know is one line listing auto.
TEST(TrainConfig, ContextModeAutoPicksByLayersAndLayout) {
  const auto dir = fixtures::temp_dir("train_test", "cmauto");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  const auto mode = [&](const std::vector<std::string>& sets) {
    const TrainConfig c = parse_train_config(good, "t.yaml", sets);
    EXPECT_TRUE(c.context_mode_auto);
    return c.model_options.context_mode;
  };
  EXPECT_EQ(mode({"parallel.context_mode=auto", "parallel.context=2"}), parallel::ContextMode::kRing);
  EXPECT_EQ(mode({"parallel.context_mode=auto", "parallel.context=2", "parallel.tensor=2"}),
            parallel::ContextMode::kAllGather);
  EXPECT_EQ(mode({"parallel.context_mode=auto", "parallel.tsp=2"}), parallel::ContextMode::kAllGather);
  EXPECT_EQ(mode({"parallel.context_mode=auto", "parallel.context=2", "model.attention=linear"}),
            parallel::ContextMode::kAllGather);
  EXPECT_EQ(mode({"parallel.context_mode=auto", "parallel.context=2", "model.layer_attention=[linear, gqa]"}),
            parallel::ContextMode::kAllGather);
  EXPECT_FALSE(parse_train_config(good, "t.yaml", {"parallel.context_mode=ring"}).context_mode_auto);
  fixtures::expect_usage_error(good, {"parallel.context_mode=rnig"},
                               "key 'parallel.context_mode' (from --set): must be allgather, ring, alltoall or auto");
}

// parallel.tensor_overlap (GPUs, sequence parallelism: backward's input re-gathers beside the
// block before): on by default, off for comparison; a word that is not a boolean is one line.
TEST(TrainConfig, TensorOverlapIsOnByDefaultAndParses) {
  const auto dir = fixtures::temp_dir("train_test", "toverlap");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  EXPECT_TRUE(parse_train_config(good, "t.yaml").model_options.tensor_overlap);
  EXPECT_FALSE(parse_train_config(good, "t.yaml", {"parallel.tensor_overlap=false"}).model_options.tensor_overlap);
  fixtures::expect_usage_error(good, {"parallel.tensor_overlap=sometimes"},
                               "key 'parallel.tensor_overlap' (from --set): must be true or false");
}

TEST(TrainConfig, CheckpointFlushBehindDefaultsTo256MiBAndParses) {
  const auto dir = fixtures::temp_dir("train_test", "flushbehind");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  EXPECT_EQ(parse_train_config(good, "t.yaml").checkpoint_flush_behind_mib, 256);
  EXPECT_EQ(parse_train_config(good, "t.yaml", {"checkpoint.flush_behind_mib=0"}).checkpoint_flush_behind_mib, 0);
  EXPECT_EQ(parse_train_config(good, "t.yaml", {"checkpoint.flush_behind_mib=64"}).checkpoint_flush_behind_mib, 64);
  fixtures::expect_usage_error(good, {"checkpoint.flush_behind_mib=-1"},
                               "key 'checkpoint.flush_behind_mib' (from --set): must be >= 0 (0: off)");
  fixtures::expect_usage_error(good, {"checkpoint.flush_behind_mib=lots"},
                               "key 'checkpoint.flush_behind_mib' (from --set): must be an integer");
}

TEST(Trainer, MissingAndTruncatedDataset) {
  const auto dir = fixtures::temp_dir("train_test", "trunc");
  const auto prefix = fixtures::make_dataset(dir, "d");
  {
    const auto c = parse_train_config(fixtures::train_config_text((dir / "nope").string(), dir / "out"), "t.yaml");
    try {
      Trainer t(c, parallel::Mesh(), true);
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos) << e.what();
    }
  }
  fs::resize_file(prefix + ".bin", fs::file_size(prefix + ".bin") - 10);
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml");
  try {
    Trainer t(c, parallel::Mesh(), true);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("d.bin"), std::string::npos) << e.what();
  }
}

TEST(Trainer, NanLossStopsNamingTheStep) {
  const auto dir = fixtures::temp_dir("train_test", "nan");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml");
  Trainer t(c, parallel::Mesh(), true);
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
  Trainer d(cfg, parallel::Mesh(), true);
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
  Trainer a(c1, parallel::Mesh(), true), b(c2, parallel::Mesh(), true);
  const auto sa = a.run(), sb = b.run();
  EXPECT_NEAR(sa[0].loss, sb[0].loss, 1e-5);
  EXPECT_NEAR(sa[0].grad_norm, sb[0].grad_norm, 1e-4 * sb[0].grad_norm);
}

TEST(Trainer, RoutingCountsAreLoggedPerLayerWhenAsked) {
  // router.log_counts: one metrics.jsonl line {"step", "time", "routing_counts": [[per class] per MoE
  // layer]} per logged step, the step's own routing (every micro-batch, before the bias update).
  const auto dir = fixtures::temp_dir("train_test", "routing_counts");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto on = parse_train_config(fixtures::train_config_text(prefix, dir / "on"), "t.yaml",
                               {"steps=3", "log_interval=1", "schedule.warmup_steps=0", "router.log_counts=true"});
  EXPECT_TRUE(on.log_routing_counts);
  Trainer a(on, parallel::Mesh(), true);
  const auto stats = a.run();
  ASSERT_EQ(stats.size(), 3u);
  std::vector<std::vector<std::vector<std::int64_t>>> logged;
  std::ifstream in(dir / "on" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("routing_counts")) continue;
    EXPECT_EQ(j["step"].get<std::int64_t>(), static_cast<std::int64_t>(logged.size()) + 1);
    logged.push_back(j["routing_counts"].get<std::vector<std::vector<std::int64_t>>>());
  }
  ASSERT_EQ(logged.size(), 3u);
  for (std::size_t s = 0; s < 3; ++s) {
    EXPECT_EQ(logged[s], stats[s].routing_counts);
    ASSERT_EQ(logged[s].size(), 1u);     // layer 1 is the one MoE layer
    ASSERT_EQ(logged[s][0].size(), 4u);  // 4 experts, no skip class
    std::int64_t routed = 0;
    for (auto c : logged[s][0]) routed += c;
    EXPECT_EQ(routed, 2 * 2 * 16 * 2);  // micro_batch x grad_accum x seq_length tokens, top-2
  }
  // off by default: nothing logged, nothing kept
  auto off = parse_train_config(fixtures::train_config_text(prefix, dir / "off"), "t.yaml",
                                {"steps=1", "log_interval=1", "schedule.warmup_steps=0"});
  EXPECT_FALSE(off.log_routing_counts);
  Trainer b(off, parallel::Mesh(), true);
  EXPECT_TRUE(b.run().at(0).routing_counts.empty());
  EXPECT_EQ(keel::read_file((dir / "off" / "metrics.jsonl").string()).find("routing_counts"), std::string::npos);
  fixtures::expect_usage_error(fixtures::train_config_text(prefix, dir / "x"), {"router.log_counts=7"},
                               "key 'router.log_counts' (from --set): must be true or false");
}

// router.forced_balance (benchmarking only): a bool, off by default; anything else is one error
// line naming the key.
TEST(TrainConfig, ForcedBalanceKey) {
  const std::string text = fixtures::train_config_text("/nonexistent/data", "/tmp/keel-forced-out");
  EXPECT_FALSE(parse_train_config(text, "t.yaml").model_options.forced_balance);
  EXPECT_TRUE(parse_train_config(text, "t.yaml", {"router.forced_balance=true"}).model_options.forced_balance);
  EXPECT_FALSE(parse_train_config(text, "t.yaml", {"router.forced_balance=false"}).model_options.forced_balance);
  expect_usage_error(text, {"router.forced_balance=2"}, "key 'router.forced_balance' (from --set): must be true or false");
}

// keel train with router.forced_balance on the tiny MoE (4 experts, top-2) and ZAYA1-tiny (4
// experts + skip, top-1): every MoE layer's step load is exactly equal over the experts, nothing
// skips, and the model still trains (the gates carry the router's gradient, the experts learn).
TEST(Trainer, ForcedBalanceRoutesEquallyAndTrains) {
  const auto dir = fixtures::temp_dir("train_test", "forced_balance");
  const auto prefix = fixtures::make_dataset(dir, "d");
  for (const bool zaya : {false, true}) {
    SCOPED_TRACE(zaya ? "zaya1-tiny" : "tiny MoE");
    auto c = parse_train_config(fixtures::train_config_text(prefix, dir / (zaya ? "zaya" : "moe")), "t.yaml",
                                {"steps=8", "log_interval=1", "router.log_counts=true", "router.forced_balance=true"});
    if (zaya) c.model = model::load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/zaya1-tiny.yaml");
    ASSERT_EQ(c.model.router_skip_expert, zaya);
    const int experts = c.model.experts, classes = experts + (zaya ? 1 : 0);
    const std::int64_t slots = 2 * 2 * 16 * c.model.top_k;  // micro_batch x grad_accum x seq_length x top_k
    Trainer t(c, parallel::Mesh(), true);
    const auto stats = t.run();
    ASSERT_EQ(stats.size(), 8u);
    for (const StepStats& s : stats) {
      SCOPED_TRACE(testing::Message() << "step " << s.step);
      EXPECT_TRUE(std::isfinite(s.loss));
      ASSERT_EQ(s.routing_counts.size(), zaya ? 2u : 1u);  // every MoE layer
      for (const auto& layer : s.routing_counts) {
        ASSERT_EQ(layer.size(), static_cast<std::size_t>(classes));
        for (int e = 0; e < experts; ++e) EXPECT_EQ(layer[e], slots / experts) << "expert " << e;
        if (zaya) EXPECT_EQ(layer[experts], 0) << "skip class";
      }
      EXPECT_DOUBLE_EQ(s.busiest_share, 1.0 / experts);
      EXPECT_EQ(s.skip_share, 0.0);
    }
    EXPECT_LT(stats.back().loss, stats.front().loss - 0.1);
  }
}

TEST(Trainer, InitFromStartsFreshOptimizerOnTheCheckpointsWeights) {
  const auto dir = fixtures::temp_dir("train_test", "init_from");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto src_cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "src"), "t.yaml", {"steps=3"});
  Trainer src(src_cfg, parallel::Mesh(), true);
  src.run();
  src.finish_checkpoint();
  const TrainState trained = src.backend().state();

  auto cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "dst"), "t.yaml",
                                {"steps=2", "init_from=" + (dir / "src").string()});
  EXPECT_EQ(cfg.init_from, (dir / "src").string());
  Trainer t(cfg, parallel::Mesh(), true);
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
  Trainer fresh(fresh_cfg, parallel::Mesh(), true);
  const double fresh_loss = fresh.run(1).front().loss;
  const double init_loss = t.run(1).front().loss;
  EXPECT_LT(init_loss, fresh_loss - 0.1) << "init_from did not carry the trained weights";

  // A resumed run takes its weights from --resume, not init_from.
  Trainer r(cfg, parallel::Mesh(), true);
  r.resume((dir / "src").string());
  r.run(3);  // nothing left: the source already did 3 steps (of its schedule's 3)
  EXPECT_EQ(r.step(), 3);
}

TEST(Trainer, InitFromRefusesWhatIsNotTheModelsWeights) {
  const auto dir = fixtures::temp_dir("train_test", "init_from_bad");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto src_cfg = parse_train_config(fixtures::train_config_text(prefix, dir / "src"), "t.yaml", {"steps=2"});
  Trainer(src_cfg, parallel::Mesh(), true).run();
  // not a checkpoint: refused before any work
  auto c1 = parse_train_config(fixtures::train_config_text(prefix, dir / "o1"), "t.yaml",
                               {"init_from=" + (dir / "nothing").string()});
  try {
    Trainer t(c1, parallel::Mesh(), true);
    FAIL() << "accepted a missing init_from";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("init_from " + (dir / "nothing").string() + ": not a keel checkpoint"),
              std::string::npos)
        << e.what();
  }
  // another model's weights: the tensor is named
  auto c2 = parse_train_config(fixtures::train_config_text(prefix, dir / "o2"), "t.yaml",
                               {"init_from=" + (dir / "src").string(), "model.hidden=32"});
  Trainer t(c2, parallel::Mesh(), true);
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


TEST(TrainConfig, RepeatedKeysAndSetValuesAreNamed) {
  const auto dir = fixtures::temp_dir("train_test", "dupcfg");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  // yaml-cpp would take the first of two values where most YAML readers take the last
  expect_usage_error(good + "steps: 3\n", {}, "bad.yaml: key 'steps' appears twice (lines");
  std::string model_dup = good;
  model_dup.replace(model_dup.find("  hidden: 16\n"), 13, "  hidden: 16\n  hidden: 32\n");
  expect_usage_error(model_dup, {}, "key 'model.hidden' appears twice");
  // values from --set have no line in the file
  expect_usage_error(good, {"optimizer.clip=.nan"}, "key 'optimizer.clip' (from --set): must be a finite number");
  expect_usage_error(good, {"data.seq_length=2147483648"}, "key 'data.seq_length' (from --set): 2147483648 is larger");
  try {
    parse_train_config(good, "bad.yaml", {"data.seq_length=0"});
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "bad.yaml (data): 'seq_length' must be at least 1");
  }
  // keys of the data: section keep their lines in the file
  std::string data_bad = good;
  data_bad.replace(data_bad.find("  seed: 7\n"), 10, "  seed: 7\n  sed: 8\n");
  const int line = 1 + static_cast<int>(std::count(data_bad.begin(), data_bad.begin() + data_bad.find("  sed:"), '\n'));
  expect_usage_error(data_bad, {}, fmt::format("unknown key 'sed' (allowed: seq_length, seed, shuffle, datasets, "
                                               "phases) (line {})", line));
}

TEST(TrainConfig, InlineModelNeedsNoTemporaryFile) {
  const auto dir = fixtures::temp_dir("train_test", "notmp");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  ::setenv("TMPDIR", "/nonexistent/keel", 1);
  TrainConfig c;
  EXPECT_NO_THROW(c = parse_train_config(fixtures::train_config_text(prefix, dir / "out"), "t.yaml"));
  old ? ::setenv("TMPDIR", saved.c_str(), 1) : ::unsetenv("TMPDIR");
  EXPECT_EQ(c.model.name, "inline");
  EXPECT_EQ(c.model.hidden, 16);
}

// Copies a step directory's metadata with one edit of its "state".
void edit_state(const fs::path& step_dir, const std::function<void(nlohmann::json&)>& edit) {
  const fs::path p = step_dir / "metadata.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(p));
  edit(m["state"]);
  std::ofstream(p) << m.dump();
}

std::string error_of(const std::function<void()>& f) { return test::error_message(f); }

TEST(Trainer, StopAtACheckpointStepSavesIt) {
  const auto dir = fixtures::temp_dir("train_test", "stop_at_interval");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", {"checkpoint.interval=3"});
  Trainer t(c, parallel::Mesh(), true);
  EXPECT_EQ(t.run(6, /*checkpoint_at_stop=*/true).size(), 6u);  // step 6 saved once, not twice
  EXPECT_TRUE(fs::exists(dir / "a" / "step_00000006" / "metadata.json"));
  EXPECT_EQ(ckpt::latest_dir((dir / "a").string()), (dir / "a" / "step_00000006").string());
  // resumed past where it would stop: nothing to do, nothing saved
  Trainer r(c, parallel::Mesh(), true);
  r.resume((dir / "a").string());
  EXPECT_TRUE(r.run(2, true).empty());
  EXPECT_EQ(r.step(), 6);
}

TEST(Trainer, ResumedRunWritesOnlyIntoItsOwnLineage) {
  const auto dir = fixtures::temp_dir("train_test", "lineage");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto ca = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", {"checkpoint.interval=3"});
  Trainer(ca, parallel::Mesh(), true).run(6, true);
  auto cb = ca;
  cb.output_dir = cb.checkpoint_dir = (dir / "b").string();
  Trainer(cb, parallel::Mesh(), true).run(3, true);
  // a's checkpoint resumed into b, which holds b's own: refused, b untouched
  {
    Trainer t(cb, parallel::Mesh(), true);
    t.resume((dir / "a").string());
    EXPECT_NE(error_of([&] { t.run(); }).find("holds another run's checkpoints (up to step 3)"), std::string::npos);
    EXPECT_EQ(t.step(), 6);
  }
  EXPECT_EQ(ckpt::latest_dir((dir / "b").string()), (dir / "b" / "step_00000003").string());
  // a rollback to step 3 of a, which holds step 6: its saves would collide
  {
    Trainer t(ca, parallel::Mesh(), true);
    t.resume((dir / "a" / "step_00000003").string());
    EXPECT_NE(error_of([&] { t.run(); }).find("holds checkpoints up to step 6, after step 3"), std::string::npos);
  }
  // ... allowed into an empty directory
  auto cc = ca;
  cc.checkpoint_dir = (dir / "branch").string();
  Trainer t(cc, parallel::Mesh(), true);
  t.resume((dir / "a" / "step_00000003").string());
  EXPECT_EQ(t.run(4, true).size(), 1u);
  EXPECT_TRUE(fs::exists(dir / "branch" / "step_00000004" / "metadata.json"));
  EXPECT_TRUE(fs::exists(dir / "a" / "step_00000006" / "metadata.json"));
}

TEST(Trainer, WhereItWritesIsCheckedBeforeAnyStep) {
  const auto dir = fixtures::temp_dir("train_test", "writes");
  const auto prefix = fixtures::make_dataset(dir, "d");
  std::ofstream(dir / "afile") << "x";
  const auto c1 = parse_train_config(fixtures::train_config_text(prefix, dir / "o1"), "t.yaml",
                                     {"checkpoint.dir=" + (dir / "afile").string(), "checkpoint.interval=4"});
  Trainer t1(c1, parallel::Mesh(), true);
  EXPECT_NE(error_of([&] { t1.run(); }).find("checkpoint.dir " + (dir / "afile").string() + ": cannot create it"),
            std::string::npos);
  EXPECT_EQ(t1.step(), 0);
  // a fresh run does not append to another run's metrics
  const auto c2 = parse_train_config(fixtures::train_config_text(prefix, dir / "o2"), "t.yaml", {"steps=2"});
  Trainer(c2, parallel::Mesh(), true).run();
  const auto size = fs::file_size(dir / "o2" / "metrics.jsonl");
  auto c3 = c2;
  c3.checkpoint_dir = (dir / "elsewhere").string();
  Trainer t3(c3, parallel::Mesh(), true);
  EXPECT_NE(error_of([&] { t3.run(); }).find("already holds another run's metrics.jsonl"), std::string::npos);
  EXPECT_EQ(fs::file_size(dir / "o2" / "metrics.jsonl"), size);
}

TEST(Trainer, EvalTokensOutsideTheVocabularyFailAtStartUp) {
  const auto dir = fixtures::temp_dir("train_test", "eval_vocab");
  const auto prefix = fixtures::make_dataset(dir, "d");
  {
    data::IndexedDatasetWriter w((dir / "ev").string(), data::TokenDtype::kUint16);
    std::vector<std::uint32_t> doc(100, 3);
    doc[40] = 30;  // vocabulary: 24
    w.add_document(doc);
    w.finish();
  }
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "o"), "t.yaml",
                                    {"eval.prefix=" + (dir / "ev").string(), "eval.batches=4"});
  try {
    Trainer t(c, parallel::Mesh(), true);
    FAIL() << "accepted an eval set the model cannot read";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("eval.prefix " + (dir / "ev").string() + ": eval sample"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("token id 30, outside the model's vocabulary (24)"), std::string::npos)
        << e.what();
  }
}

TEST(Trainer, ResumeRefusesAChangedDatasetOrADamagedState) {
  const auto dir = fixtures::temp_dir("train_test", "resume_checks");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto other = fixtures::make_dataset(dir, "smaller", 20);
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml");
  Trainer(c, parallel::Mesh(), true).run(3, true);
  auto changed = c;
  changed.data.prefixes[0] = other;
  Trainer t(changed, parallel::Mesh(), true);
  EXPECT_NE(error_of([&] { t.resume((dir / "a").string()); }).find("the dataset changed"), std::string::npos);
  const fs::path step = dir / "a" / "step_00000003";
  edit_state(step, [](nlohmann::json& s) { s["step"] = "abc"; });
  Trainer u(c, parallel::Mesh(), true);
  EXPECT_NE(error_of([&] { u.resume((dir / "a").string()); })
                .find(step.string() + ": state 'step' is \"abc\" (expected a non-negative integer)"),
            std::string::npos);
  edit_state(step, [](nlohmann::json& s) { s["step"] = 2; });
  EXPECT_NE(error_of([&] { u.resume((dir / "a").string()); }).find("its state says step 2 but its metadata step 3"),
            std::string::npos);
  edit_state(step, [](nlohmann::json& s) {
    s["step"] = 3;
    s.erase("optimizer_step");
  });
  EXPECT_NE(error_of([&] { u.resume((dir / "a").string()); }).find("state 'optimizer_step' is missing"),
            std::string::npos);
}

}  // namespace
}  // namespace keel::train

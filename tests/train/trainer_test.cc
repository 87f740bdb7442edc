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

namespace keel::train {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("keel_train_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A small dataset of "documents" with structure (repeating ramps) so the loss can fall.
std::string make_dataset(const fs::path& dir, const std::string& name, int docs = 40) {
  const std::string prefix = (dir / name).string();
  data::IndexedDatasetWriter w(prefix, data::TokenDtype::kUint16);
  for (int d = 0; d < docs; ++d) {
    std::vector<std::uint32_t> t;
    for (int i = 0; i < 30 + d % 7; ++i) t.push_back(static_cast<std::uint32_t>((d + i) % 20));
    w.add_document(t);
  }
  w.finish();
  return prefix;
}

// device: cpu: these tests pin the CPU reference (bit-exact resume, exact grad-accum equality);
// the GPU backend has its own tests (cuda_backend_cuda_test.cc).
std::string config_text(const std::string& prefix, const fs::path& out) {
  return R"(
device: cpu
model:
  vocab_size: 24
  hidden: 16
  layers: 2
  attention: gqa
  heads: 4
  kv_heads: 2
  ffn_hidden: 32
  experts: 4
  top_k: 2
  expert_hidden: 16
  first_dense_layers: 1
  max_seq_len: 64
router:
  aux_loss_weight: 0.01
  z_loss_weight: 0.001
  bias_update_rate: 0.01
data:
  datasets: {train: )" + prefix + R"(}
  seq_length: 16
  seed: 7
optimizer:
  lr: 0.01
  weight_decay: 0.01
  clip: 1.0
schedule:
  kind: cosine
  warmup_steps: 2
batch:
  micro_batch: 2
  grad_accum: 2
steps: 12
log_interval: 4
output_dir: )" + out.string() + "\n";
}

TEST(TrainConfig, ParsesAndOverrides) {
  const auto dir = temp_dir("cfg");
  const auto prefix = make_dataset(dir, "d");
  const auto c = parse_train_config(config_text(prefix, dir / "out"), "t.yaml",
                                    {"optimizer.lr=0.5", "batch.grad_accum=3", "recompute=full", "schedule.kind=wsd"});
  EXPECT_DOUBLE_EQ(c.schedule.peak_lr, 0.5);
  EXPECT_EQ(c.grad_accum, 3);
  EXPECT_EQ(c.model_options.recompute, Recompute::kFull);
  EXPECT_EQ(c.schedule.kind, optim::ScheduleKind::kWsd);
  EXPECT_EQ(c.model.experts, 4);
  EXPECT_EQ(c.data.seq_length, 16u);
  EXPECT_EQ(c.data.phases.size(), 1u);
}

void expect_usage_error(const std::string& text, const std::vector<std::string>& sets, const std::string& needle) {
  try {
    parse_train_config(text, "bad.yaml", sets);
    FAIL() << "accepted; expected an error containing: " << needle;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "multi-line error: " << e.what();
  }
}

TEST(TrainConfig, BadConfigsGiveClearErrors) {
  const auto dir = temp_dir("badcfg");
  const auto prefix = make_dataset(dir, "d");
  const std::string good = config_text(prefix, dir / "out");
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
  const auto dir = temp_dir("linear");
  const auto prefix = make_dataset(dir, "d");
  auto c = parse_train_config(config_text(prefix, dir / "out"), "t.yaml");
  c.model.attention = model::AttentionKind::kLinear;
  try {
    Trainer t(c, ParallelContext::single(), true);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("supports mha, gqa and cca"), std::string::npos) << e.what();
  }
}

TEST(Trainer, MissingAndTruncatedDataset) {
  const auto dir = temp_dir("trunc");
  const auto prefix = make_dataset(dir, "d");
  {
    const auto c = parse_train_config(config_text((dir / "nope").string(), dir / "out"), "t.yaml");
    try {
      Trainer t(c, ParallelContext::single(), true);
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos) << e.what();
    }
  }
  fs::resize_file(prefix + ".bin", fs::file_size(prefix + ".bin") - 10);
  const auto c = parse_train_config(config_text(prefix, dir / "out"), "t.yaml");
  try {
    Trainer t(c, ParallelContext::single(), true);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("d.bin"), std::string::npos) << e.what();
  }
}

TEST(Trainer, NanLossStopsNamingTheStep) {
  const auto dir = temp_dir("nan");
  const auto prefix = make_dataset(dir, "d");
  const auto c = parse_train_config(config_text(prefix, dir / "out"), "t.yaml");
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
  const auto dir = temp_dir("resume");
  const auto prefix = make_dataset(dir, "d");
  auto cfg = parse_train_config(config_text(prefix, dir / "a"), "t.yaml", {"eval.prefix=" + prefix, "eval.interval=5"});
  // uninterrupted
  Trainer a(cfg, ParallelContext::single(), true);
  const auto sa = a.run();
  ASSERT_EQ(sa.size(), 12u);
  EXPECT_LT(sa.back().ce, sa.front().ce);
  // 5 steps, checkpoint, a fresh trainer resumes for the rest
  cfg.output_dir = cfg.checkpoint_dir = (dir / "b").string();
  std::vector<StepStats> sb;
  {
    Trainer b(cfg, ParallelContext::single(), true);
    sb = b.run(5);
    b.save_checkpoint();
    b.finish_checkpoint();
  }
  Trainer c(cfg, ParallelContext::single(), true);
  c.resume((dir / "b").string());
  EXPECT_EQ(c.step(), 5);
  const auto sc = c.run();
  sb.insert(sb.end(), sc.begin(), sc.end());
  ASSERT_EQ(sb.size(), sa.size());
  for (std::size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].loss, sb[i].loss) << "step " << i + 1;
    EXPECT_EQ(sa[i].grad_norm, sb[i].grad_norm) << "step " << i + 1;
  }
  const TrainState sa_state = a.backend().state(), sc_state = c.backend().state();
  EXPECT_EQ(0, std::memcmp(sa_state.params.data(), sc_state.params.data(), sa_state.params.size() * sizeof(float)));
  EXPECT_EQ(sa_state.adam_m, sc_state.adam_m);
  EXPECT_EQ(sa_state.router_bias, sc_state.router_bias);
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
  const auto dir = temp_dir("accum");
  const auto prefix = make_dataset(dir, "d");
  auto c1 = parse_train_config(config_text(prefix, dir / "o1"), "t.yaml",
                               {"steps=1", "schedule.warmup_steps=0", "router.aux_loss_weight=0", "router.z_loss_weight=0"});
  auto c2 = parse_train_config(config_text(prefix, dir / "o2"), "t.yaml",
                               {"steps=1", "schedule.warmup_steps=0", "batch.micro_batch=4", "batch.grad_accum=1", "router.aux_loss_weight=0",
                                "router.z_loss_weight=0"});
  Trainer a(c1, ParallelContext::single(), true), b(c2, ParallelContext::single(), true);
  const auto sa = a.run(), sb = b.run();
  EXPECT_NEAR(sa[0].loss, sb[0].loss, 1e-5);
  EXPECT_NEAR(sa[0].grad_norm, sb[0].grad_norm, 1e-4 * sb[0].grad_norm);
}

}  // namespace
}  // namespace keel::train

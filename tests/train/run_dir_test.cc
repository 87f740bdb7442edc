// keel train's run directory under bad luck (issue 34): a `latest` pointer behind a newer commit,
// a run that died before its first checkpoint, a checkpoint missing optimizer state or its
// sampler position, a resume with another config, a stop request, and the directory lock (in
// one process; two processes: tests/train/run_dir.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/store.h"
#include "ckpt/tools.h"
#include "common/dir_lock.h"
#include "train/trainer.h"

#include "train_test_util.h"
#include "../error_message.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& f) { return test::error_message(f); }

void edit_metadata(const fs::path& step_dir, const std::function<void(nlohmann::json&)>& edit) {
  const fs::path p = step_dir / "metadata.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(p));
  edit(m);
  std::ofstream(p) << m.dump();
}

void drop_tensor(const fs::path& step_dir, const std::string& name) {
  edit_metadata(step_dir, [&](nlohmann::json& m) {
    auto& t = m["tensors"];
    const auto before = t.size();
    t.erase(std::remove_if(t.begin(), t.end(), [&](const nlohmann::json& x) { return x["name"] == name; }), t.end());
    ASSERT_EQ(t.size() + 1, before) << name;
  });
}

std::size_t lines_of(const fs::path& p) {
  std::ifstream f(p);
  std::size_t n = 0;
  for (std::string l; std::getline(f, l);) ++n;
  return n;
}

// Item 4: the disk filled between a commit and the `latest` update.
TEST(TrainRunDir, ResumeTakesTheNewestCommittedStepWhenLatestLagsBehind) {
  const auto dir = fixtures::temp_dir("run_dir", "latest_lags");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", {"checkpoint.interval=4"});
  Trainer(c, parallel::Mesh(), true).run(8, true);
  std::ofstream(dir / "a" / "latest") << "step_00000004\n";
  {
    Trainer t(c, parallel::Mesh(), true);
    t.resume((dir / "a").string());
    EXPECT_EQ(t.step(), 8);
    EXPECT_EQ(t.run(10, true).size(), 2u);  // not refused as a rollback
  }
  EXPECT_EQ(ckpt::latest_dir((dir / "a").string()), (dir / "a" / "step_00000010").string());
  // no `latest` at all (a crash between the first commit and its pointer): the same
  fs::remove(dir / "a" / "latest");
  Trainer u(c, parallel::Mesh(), true);
  u.resume((dir / "a").string());
  EXPECT_EQ(u.step(), 10);
  // ... and a fresh run still does not write over those committed steps
  Trainer f(c, parallel::Mesh(), true);
  EXPECT_NE(error_of([&] { f.run(); }).find("already holds checkpoints (up to step 10): continue with --resume"),
            std::string::npos);
}

// Item 5: a run that died before its first checkpoint leaves a metrics.jsonl and no checkpoint.
TEST(TrainRunDir, ResumeOfItsOwnDirectoryWithNothingCommittedStartsAtStepZero) {
  const auto dir = fixtures::temp_dir("run_dir", "no_checkpoint");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", {"steps=4"});
  auto nosave = c;
  nosave.checkpoint_final = false;
  Trainer(nosave, parallel::Mesh(), true).run();
  const std::size_t before = lines_of(dir / "a" / "metrics.jsonl");
  ASSERT_GT(before, 0u);
  ASSERT_TRUE(ckpt::list_steps((dir / "a").string()).empty());
  // a fresh run is refused, pointing at --resume of the directory ...
  Trainer f(c, parallel::Mesh(), true);
  EXPECT_NE(error_of([&] { f.run(); }).find("continue that run with --resume " + (dir / "a").string()),
            std::string::npos);
  // ... which now works: from step 0, into the same directory, the log appended (and a save torn
  // by the crash, never committed, replaced by the new one)
  fs::create_directories(dir / "a" / "step_00000004");
  std::ofstream(dir / "a" / "step_00000004" / "data_r00000_b0.bin") << "torn";
  Trainer t(c, parallel::Mesh(), true);
  t.resume((dir / "a").string());
  EXPECT_EQ(t.step(), 0);
  EXPECT_EQ(t.run().size(), 4u);
  EXPECT_GT(lines_of(dir / "a" / "metrics.jsonl"), before);
  EXPECT_TRUE(fs::exists(dir / "a" / "step_00000004" / "metadata.json"));
  // another directory that holds no checkpoint is still not one
  Trainer o(c, parallel::Mesh(), true);
  EXPECT_NE(error_of([&] { o.resume((dir / "elsewhere").string()); }).find("not a keel checkpoint"), std::string::npos);
}

// Item 6: a checkpoint without an AdamW second moment is named by verify and by the resume.
TEST(TrainRunDir, MissingOptimizerStateIsNamedByVerifyAndResume) {
  const auto dir = fixtures::temp_dir("run_dir", "missing_v");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml");
  Trainer(c, parallel::Mesh(), true).run(3, true);
  const fs::path step = dir / "a" / "step_00000003";
  auto verified = ckpt::verify_checkpoint(step.string());
  EXPECT_TRUE(verified.problems.empty());
  EXPECT_EQ(verified.note, "a complete train state");
  drop_tensor(step, "optim/exp_avg_sq/embed.weight");
  verified = ckpt::verify_checkpoint(step.string());
  ASSERT_EQ(verified.problems.size(), 1u);
  EXPECT_NE(verified.problems[0].find("incomplete train state: tensor 'optim/exp_avg_sq/embed.weight'"),
            std::string::npos)
      << verified.problems[0];
  Trainer t(c, parallel::Mesh(), true);
  const std::string e = error_of([&] { t.resume((dir / "a").string()); });
  EXPECT_NE(e.find("tensor 'optim/exp_avg_sq/embed.weight' (AdamW's second moment of 'embed.weight') is missing"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("not a complete train state"), std::string::npos) << e;
  EXPECT_EQ(e.find("Muon"), std::string::npos) << e;
  // saved before keel recorded muon_params: a parameter AdamW trains in any run still needs its v
  edit_metadata(step, [](nlohmann::json& m) { m["state"].erase("muon_params"); });
  EXPECT_NE(error_of([&] { t.resume((dir / "a").string()); }).find("AdamW trains that parameter with or without Muon"),
            std::string::npos);
  // a first moment missing too
  drop_tensor(step, "optim/exp_avg/final_norm.weight");
  EXPECT_FALSE(ckpt::verify_checkpoint(step.string()).problems.empty());
}

// ... while a Muon checkpoint (no v for its Muon parameters, by design) is complete and resumes.
TEST(TrainRunDir, AMuonCheckpointIsACompleteTrainState) {
  const auto dir = fixtures::temp_dir("run_dir", "muon_complete");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c =
      parse_train_config(fixtures::train_config_text(prefix, dir / "a", "  muon:\n    enabled: true\n"), "t.yaml");
  Trainer(c, parallel::Mesh(), true).run(2, true);
  const fs::path step = dir / "a" / "step_00000002";
  const auto v = ckpt::verify_checkpoint(step.string());
  EXPECT_TRUE(v.problems.empty()) << v.problems.front();
  EXPECT_EQ(v.note, "a complete train state");
  Trainer t(c, parallel::Mesh(), true);
  t.resume((dir / "a").string());
  EXPECT_EQ(t.step(), 2);
}

// Item 12 (the checkpoint's part): the sampler position missing or damaged is named, no JSON internals.
TEST(TrainRunDir, SamplerStateMissingOrDamagedIsNamed) {
  const auto dir = fixtures::temp_dir("run_dir", "sampler");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml");
  Trainer(c, parallel::Mesh(), true).run(2, true);
  const fs::path step = dir / "a" / "step_00000002";
  const std::string metadata = (step / "metadata.json").string();
  edit_metadata(step, [](nlohmann::json& m) { m["state"].erase("sampler"); });
  Trainer t(c, parallel::Mesh(), true);
  std::string e = error_of([&] { t.resume((dir / "a").string()); });
  EXPECT_NE(e.find("checkpoint " + metadata + ": state 'sampler' is missing (expected the data sampler's position"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("json.exception"), std::string::npos) << e;
  edit_metadata(step, [](nlohmann::json& m) { m["state"]["sampler"] = 5; });
  e = error_of([&] { t.resume((dir / "a").string()); });
  EXPECT_NE(e.find("state 'sampler' is 5 (expected"), std::string::npos) << e;
  edit_metadata(step, [](nlohmann::json& m) { m["state"]["sampler"] = {{"kind", "single"}, {"seed", "x"}}; });
  e = error_of([&] { t.resume((dir / "a").string()); });
  EXPECT_NE(e.find("checkpoint " + metadata + ": state 'sampler'"), std::string::npos) << e;
  EXPECT_EQ(e.find("json.exception"), std::string::npos) << e;
  edit_metadata(step, [](nlohmann::json& m) { m["state"].erase("sampler"); });
  const auto v = ckpt::verify_checkpoint(step.string());
  ASSERT_EQ(v.problems.size(), 1u);
  EXPECT_NE(v.problems[0].find("train state 'sampler' (the data sampler's position) is missing"), std::string::npos);
}

// Item 14: a resume says what it changes; another model is refused naming the model keys.
TEST(TrainRunDir, ResumeSaysWhatTheConfigChanges) {
  const auto dir = fixtures::temp_dir("run_dir", "config_changes");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml");
  Trainer(c, parallel::Mesh(), true).run(2, true);
  const auto changed = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml",
                                          {"optimizer.lr=0.005", "batch.micro_batch=4", "batch.grad_accum=1"});
  testing::internal::CaptureStdout();
  {
    Trainer t(changed, parallel::Mesh(), false);
    t.resume((dir / "a").string());
  }
  std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("resumed with config changes (checkpoint -> now): batch.grad_accum 2 -> 1, batch.micro_batch 2 -> "
                     "4, optimizer.lr 0.01 -> 0.005\n"),
            std::string::npos)
      << out;
  // the same config: no such line
  testing::internal::CaptureStdout();
  {
    Trainer t(c, parallel::Mesh(), false);
    t.resume((dir / "a").string());
  }
  out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(out.find("config changes"), std::string::npos) << out;
  // another model: refused as before, now naming the model keys that differ
  const auto other = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", {"model.hidden=32"});
  Trainer t(other, parallel::Mesh(), true);
  const std::string e = error_of([&] { t.resume((dir / "a").string()); });
  EXPECT_NE(e.find("(the model keys changed: model.hidden 16 -> 32)"), std::string::npos) << e;
}

// Item 13: a stop request ends the run at a step boundary with that step saved.
TEST(TrainRunDir, StopRequestSavesTheStepAndStops) {
  const auto dir = fixtures::temp_dir("run_dir", "stop");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(fixtures::train_config_text(prefix, dir / "a"), "t.yaml", {"checkpoint.interval=100"});
  Trainer t(c, parallel::Mesh(), true);
  int polls = 0;
  t.stop_when([&] { return ++polls > 5 ? SIGTERM : 0; });
  EXPECT_EQ(t.run().size(), 5u);
  EXPECT_EQ(t.stopped_by(), SIGTERM);
  EXPECT_EQ(ckpt::latest_dir((dir / "a").string()), (dir / "a" / "step_00000005").string());
  // a resume continues from it
  Trainer r(c, parallel::Mesh(), true);
  r.resume((dir / "a").string());
  EXPECT_EQ(r.step(), 5);
  EXPECT_EQ(r.stopped_by(), 0);
}

// Item 1, in one process: the lock is shared by one process's trainers, released when the last
// goes, and a line a dead holder left is recognised as stale.
TEST(TrainRunDir, DirLockIsPerProcessAndRecognisesAStaleHolder) {
  const auto dir = fixtures::temp_dir("run_dir", "lock");
  const fs::path file = dir / DirLock::kFileName;
  {
    auto a = DirLock::acquire(dir.string(), "first");
    ASSERT_TRUE(a.lock);
    EXPECT_TRUE(a.stale.empty());
    auto b = DirLock::acquire(dir.string(), "second");
    EXPECT_EQ(a.lock, b.lock);  // the same process: the same lock
    std::ifstream f(file);
    std::string line;
    std::getline(f, line);
    EXPECT_EQ(line, "first");
  }
  EXPECT_EQ(fs::file_size(file), 0u);  // a clean release leaves no holder
  std::ofstream(file) << "pid 1 on host gone since then (keel train x.yaml)\n";  // a holder that died
  auto c = DirLock::acquire(dir.string(), lock_holder_line("keel train t.yaml"));
  ASSERT_TRUE(c.lock);
  EXPECT_EQ(c.stale, "pid 1 on host gone since then (keel train x.yaml)");
}

}  // namespace
}  // namespace keel::train

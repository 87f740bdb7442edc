// keel train with expert parallelism on CPU ranks under MPI (run at 2, 3, 4 and 8 ranks; 24
// experts and 24 micro-batches per step so every degree divides them): with EP = the world, and at 4 ranks also EP = 2 (two ranks
// holding each expert), a run matches the 1-rank run of the same global batch within
// fp32-reduction tolerance (linear router top-2 with AdamW and with Muon; the ZAYA1 MLP router
// with the skip class); each rank holds exactly its experts and a ZeRO-1 shard of their optimizer
// state; checkpoints move between EP and
// one rank both ways and the loss continues as in the uninterrupted run.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "train/model.h"
#include "train/trainer.h"
#include "train_mpi_test_util.h"
#include "train_test_util.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;
using keel::test::world_rank;
using keel::test::world_size;

using fixtures::world_context;

fs::path shared_dir(const std::string& name) { return keel::test::shared_temp_dir("ep_mpi", name); }

// The tests' tiny model with 24 experts, 24 micro-batches of 1 sequence per step.
TrainConfig config(const fs::path& dir, const fs::path& out, int ep, const std::vector<std::string>& extra = {},
                   const std::string& optimizer_extra = "") {
  if (world_rank() == 0 && !fs::exists(dir / "d.idx")) fixtures::make_dataset(dir, "d");
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> sets = {"batch.micro_batch=1", "batch.grad_accum=24", "steps=6", "model.experts=24",
                                   "parallel.expert=" + std::to_string(ep)};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_train_config(fixtures::train_config_text((dir / "d").string(), out, optimizer_extra), "ep.yaml", sets);
}

const std::string& kMuon = fixtures::kMuonOptimizer;
const std::vector<std::string>& kZayaRouter = fixtures::kZayaRouterSets;

// Every parameter of `ep_state` (an expert-parallel rank's) against the same elements of the
// whole model's `full` state: the largest difference relative to the largest value.
double max_rel_diff_by_name(const optim::ParamLayout& ep_layout, const std::vector<float>& ep_params, int expert_rank,
                            const optim::ParamLayout& full_layout, const std::vector<float>& full_params) {
  std::map<std::string, const optim::ParamInfo*> full;
  for (const auto& p : full_layout.params) full[p.name] = &p;
  double num = 0, den = 0;
  for (const auto& p : ep_layout.params) {
    const optim::ParamInfo& f = *full.at(p.name);
    const std::int64_t first = p.placement.splits(mesh::Axis::kExpert) && p.numel < f.numel ? expert_rank * p.numel : 0;
    for (std::int64_t i = 0; i < p.numel; ++i) {
      const double a = ep_params[p.offset + i], b = full_params[f.offset + first + i];
      num = std::max(num, std::fabs(a - b));
      den = std::max(den, std::fabs(b));
    }
  }
  return den > 0 ? num / den : num;
}

void expect_matches_single_rank(int ep, const std::vector<std::string>& extra, const std::string& optimizer_extra,
                                const std::string& tag) {
  if (world_size() % ep != 0) GTEST_SKIP() << "EP " << ep << " does not divide " << world_size() << " ranks";
  const fs::path dir = shared_dir(tag);
  std::vector<std::string> sets = extra;
  sets.push_back("checkpoint.final=false");
  TrainConfig cfg = config(dir, dir / "ep", ep, sets, optimizer_extra);
  const parallel::Mesh ctx = world_context(ep);
  Trainer t(cfg, ctx, true);
  // Each rank holds E / ep experts of every MoE layer: the layout says so.
  std::int64_t experts_begin = t.backend().layout().total_floats;
  for (const auto& p : t.backend().layout().params)
    if (p.placement.splits(mesh::Axis::kExpert)) {
      ASSERT_EQ(p.shape[0], 24 / ep) << p.name;
      experts_begin = std::min(experts_begin, p.offset);
    }
  // ZeRO-1 over the ranks holding the same experts: their optimizer shards tile the expert
  // region once, so over the world it is covered ep times (once per expert group).
  const StateSlice sl = t.backend().state_slice();
  std::int64_t covered = sl.expert_end - sl.expert_begin;
  MPI_Allreduce(MPI_IN_PLACE, &covered, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(covered, ep * (t.backend().layout().total_floats - experts_begin)) << tag;
  EXPECT_EQ(t.backend().state().adam_m.size(), static_cast<std::size_t>(sl.moments())) << tag;
  const auto got = t.run();
  TrainConfig one = cfg;
  one.parallel_expert = 1;
  one.output_dir = one.checkpoint_dir = (dir / ("single" + std::to_string(world_rank()))).string();
  Trainer single(one, parallel::Mesh(), true);
  const auto want = single.run();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i].loss, want[i].loss, 1e-5 * std::fabs(want[i].loss)) << tag << " step " << i + 1;
    EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, 1e-4 * want[i].grad_norm) << tag << " step " << i + 1;
  }
  EXPECT_LT(max_rel_diff_by_name(t.backend().layout(), t.backend().state().params, ctx.expert().rank,
                                 single.backend().layout(), single.backend().state().params),
            2e-5)
      << tag;
  EXPECT_EQ(t.backend().param_count(), single.backend().param_count()) << "the whole model's count on every rank";
}

TEST(ExpertParallel, EpWorldMatchesOneRankWithAdamW) { expect_matches_single_rank(world_size(), {}, "", "adamw"); }
TEST(ExpertParallel, EpWorldMatchesOneRankWithMuon) { expect_matches_single_rank(world_size(), {}, kMuon, "muon"); }
TEST(ExpertParallel, EpWorldMatchesOneRankWithTheZayaRouter) {
  expect_matches_single_rank(world_size(), kZayaRouter, "", "zaya");
}
TEST(ExpertParallel, EpTwoWithReplicasMatchesOneRank) {
  if (world_size() < 4) GTEST_SKIP() << "needs 4 ranks: EP 2 with 2 ranks per expert";
  expect_matches_single_rank(2, {}, kMuon, "ep2");
}

// Trains to step 3 and saves at EP `save_ep` over the world (or on one rank: 0), resumes at
// `resume_ep` (or one rank: 0) and finishes; steps 4..6 match the uninterrupted run there.
void expect_resume(int save_ep, int resume_ep, const std::string& tag) {
  const fs::path dir = shared_dir(tag);
  const auto ctx = [&](int ep) { return ep > 0 ? world_context(ep) : parallel::Mesh(); };
  const auto out = [&](const std::string& name, int ep) { return ep > 0 ? dir / name : dir / (name + std::to_string(world_rank())); };
  TrainConfig full_cfg = config(dir, out("full", resume_ep), std::max(resume_ep, 1), {"checkpoint.final=false"}, kMuon);
  Trainer full(full_cfg, ctx(resume_ep), true);
  const auto expect = full.run();
  TrainConfig first_cfg = config(dir, out("first", save_ep), std::max(save_ep, 1), {"checkpoint.interval=3"}, kMuon);
  {
    Trainer first(first_cfg, ctx(save_ep), true);
    first.run(3);
    first.finish_checkpoint();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  TrainConfig second_cfg = config(dir, out("second", resume_ep), std::max(resume_ep, 1), {"checkpoint.final=false"}, kMuon);
  Trainer second(second_cfg, ctx(resume_ep), true);
  second.resume(first_cfg.checkpoint_dir);
  ASSERT_EQ(second.step(), 3);
  const auto got = second.run();
  ASSERT_EQ(got.size(), 3u);
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (save_ep == resume_ep)
      EXPECT_EQ(got[i].loss, expect[i + 3].loss) << tag << ": resume in the same layout is bit-exact, step " << i + 4;
    else
      EXPECT_NEAR(got[i].loss, expect[i + 3].loss, 1e-5 * std::fabs(expect[i + 3].loss)) << tag << " step " << i + 4;
  }
}

TEST(ExpertParallel, ResumesInTheSameLayoutBitExact) { expect_resume(world_size(), world_size(), "resume_same"); }
TEST(ExpertParallel, CheckpointOfEpResumesOnOneRank) { expect_resume(world_size(), 0, "resume_ep_1"); }
TEST(ExpertParallel, CheckpointOfOneRankResumesAtEp) { expect_resume(0, world_size(), "resume_1_ep"); }
TEST(ExpertParallel, CheckpointOfEpWorldResumesAtEpTwo) {
  if (world_size() < 4) GTEST_SKIP() << "needs 4 ranks";
  expect_resume(world_size(), 2, "resume_ep4_ep2");
}

TEST(ExpertParallel, InitFromAOneRankCheckpointGivesEachRankItsExperts) {
  const int ep = world_size();
  const fs::path dir = shared_dir("init_from");
  // one rank trains 2 steps and saves (each rank its own copy; rank 0's is the source)
  TrainConfig src_cfg = config(dir, dir / ("src" + std::to_string(world_rank())), 1, {"steps=2"});
  Trainer src(src_cfg, parallel::Mesh(), true);
  src.run();
  src.finish_checkpoint();
  MPI_Barrier(MPI_COMM_WORLD);
  TrainConfig cfg = config(dir, dir / "ep", ep, {"checkpoint.final=false", "init_from=" + (dir / "src0").string()});
  const parallel::Mesh ctx = world_context(ep);
  Trainer t(cfg, ctx, true);
  t.run(0);
  EXPECT_EQ(max_rel_diff_by_name(t.backend().layout(), t.backend().state().params, ctx.expert().rank,
                                 src.backend().layout(), src.backend().state().params),
            0.0)
      << "each rank holds exactly its experts' trained weights";
  for (float m : t.backend().state().adam_m) ASSERT_EQ(m, 0.f);
}

}  // namespace
}  // namespace keel::train

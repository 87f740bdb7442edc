// keel train with TSP (parallel.tsp: tensor and sequence parallelism folded onto one axis) on
// CPU ranks under MPI (run at 2, 3 and 4 ranks): each rank holds 1/D of every weight matrix and
// 1/D of each sequence's tokens; 20 steps match the one-rank run of the same global batch within
// 1e-5 relative per step, alone (D = the world: 2, 3, or 4 with the kv heads replicated), with
// data parallelism + ZeRO-1 (D=2 x DP=2), with expert parallelism (folded over the data ranks),
// with Muon, on the tiny MoE, the ZAYA1-shaped tiny model (CCA, MLP router with the skip class,
// residual scaling), a sliding-window layer and the LASP-2H hybrid. Checkpoints move between TSP
// and one rank and TP. Bad combinations are one clear error. On GPUs (a GPU per rank, the world
// one tsp group; skipped otherwise): the first step's loss, gradient norm and every gradient
// block against one GPU at bf16 tolerance, then training; checkpoints from the tsp group read
// back exactly on one GPU and at TP=2.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "common/error.h"
#include "device/cuda_devices.h"
#include "group_compare_util.h"
#include "train/trainer.h"
#include "train_mpi_test_util.h"
#include "train_test_util.h"
#include "world_run_util.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;
using keel::test::world_rank;
using keel::test::world_size;

fs::path shared_dir(const std::string& name) { return keel::test::shared_temp_dir("tsp_mpi", name); }

parallel::Mesh tsp_mesh(int tsp, int ep = 1, int tp = 1) {
  mesh::Shape s;
  s.tsp = tsp;
  s.tp = tp;
  s.dp = world_size() / (tsp * tp);
  s.ep = ep;
  s.zero = s.dp > 1 ? 1 : 0;
  return parallel::Mesh(s, MPI_COMM_WORLD);
}

using fixtures::joined;
using fixtures::kHybrid;
using fixtures::kSliding;
using fixtures::kZaya;
using fixtures::kZayaGpu;

// The tiny MoE with widths D = 3 divides: 6 heads of 4 (3 kv heads) over a hidden of 24.
std::vector<std::string> widths_for(int d) {
  if (d != 3) return {};
  return {"model.hidden=24", "model.heads=6", "model.kv_heads=3", "model.ffn_hidden=24", "model.expert_hidden=12"};
}

TrainConfig config(const fs::path& dir, const fs::path& out, const std::vector<std::string>& extra,
                   const std::string& optimizer_extra = "") {
  return fixtures::world_config(dir, out, extra, optimizer_extra, "tsp.yaml");
}

struct Case {
  int tsp = 2, ep = 1;
  std::vector<std::string> sets;
  std::string optimizer;
  std::string tag;
  std::string tables = "sweep";  // parallel.tsp_tables (auto would pick by the batch's size)
};

void expect_matches_single_rank(const Case& c) {
  if (world_size() % c.tsp != 0) GTEST_SKIP() << "tsp " << c.tsp << " does not divide " << world_size();
  const int dp = world_size() / c.tsp;
  if (dp % c.ep != 0) GTEST_SKIP() << "ep does not divide dp";
  const fs::path dir = shared_dir(c.tag);
  std::vector<std::string> sets = joined(widths_for(c.tsp), c.sets);
  sets.push_back("parallel.tsp=" + std::to_string(c.tsp));
  sets.push_back("parallel.tsp_tables=" + c.tables);
  if (c.ep > 1) sets.push_back("parallel.expert=" + std::to_string(c.ep));
  if (dp > 1) sets.insert(sets.end(), {"batch.micro_batch=1", "batch.grad_accum=" + std::to_string(4 * dp)});
  TrainConfig cfg = config(dir, dir / "tsp", sets, c.optimizer);
  Trainer t(cfg, tsp_mesh(c.tsp, c.ep), true);
  TrainConfig one = cfg;
  one.parallel_tsp = one.parallel_expert = 1;
  one.output_dir = one.checkpoint_dir = (dir / ("single" + std::to_string(world_rank()))).string();
  Trainer single(one, parallel::Mesh(), true);
  const auto got = t.run();  // collective: before the one-rank run, on every rank
  const auto want = single.run();
  fixtures::expect_same_steps(got, want, c.tag);
}

const std::string& kMuon = fixtures::kMuonOptimizer;

TEST(Tsp, WorldMatchesOneRank) { expect_matches_single_rank({world_size(), 1, {}, "", "tspN"}); }
TEST(Tsp, WorldWithMuonMatchesOneRank) { expect_matches_single_rank({world_size(), 1, {}, kMuon, "tspN_muon"}); }
TEST(Tsp, WorldSlidingMatchesOneRank) { expect_matches_single_rank({world_size(), 1, kSliding, "", "tspN_sliding"}); }
// TSP past CCA's 2 kv heads is refused: D = 2 (x DP 2 at 4 ranks)
TEST(Tsp, Tsp2ZayaMatchesOneRank) { expect_matches_single_rank({2, 1, kZaya, "", "zaya_tsp2"}); }
// The MLP router's aux loss on: every shard routes alike, the first shard's pass adds its gradient.
TEST(Tsp, Tsp2ZayaAuxLossMatchesOneRank) { expect_matches_single_rank({2, 1, fixtures::kZayaAux, "", "zaya_aux_tsp2"}); }
TEST(Tsp, Tsp2ZayaSlidingWithMuonMatchesOneRank) {
  expect_matches_single_rank({2, 1, joined(kZaya, kSliding), kMuon, "zaya_sliding_tsp2"});
}
TEST(Tsp, Tsp2HybridMatchesOneRank) {  // LASP-2 for the linear layer on the same axis
  expect_matches_single_rank({2, 1, kHybrid, "", "hybrid_tsp2"});
}
// The tables' rows stay and the tokens travel (parallel.tsp_tables: gather): the untied tiny MoE,
// ZAYA1's tied table, and with data and expert parallelism.
TEST(Tsp, WorldGatheringTablesMatchesOneRank) {
  expect_matches_single_rank({world_size(), 1, {}, "", "tspN_gather", "gather"});
}
TEST(Tsp, Tsp2ZayaGatheringTablesMatchesOneRank) {
  expect_matches_single_rank({2, 1, kZaya, kMuon, "zaya_tsp2_gather", "gather"});
}
TEST(Tsp, Tsp2TimesDp2ZayaGatheringTablesWithExpertParallelMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 2, kZaya, "", "zaya_tsp2_ep2_gather", "gather"});
}
// Each shard's k and v passed around the group instead of gathered (parallel.context_mode: ring):
// the tiny MoE at D = 2-4, ZAYA1 (CCA's halos beside the ring), the hybrid (LASP-1 for its linear
// layer).
TEST(Tsp, WorldRingMatchesOneRank) {
  expect_matches_single_rank({world_size(), 1, {"parallel.context_mode=ring"}, "", "tspN_ring"});
}
TEST(Tsp, Tsp2ZayaRingMatchesOneRank) {
  expect_matches_single_rank({2, 1, joined(kZaya, {"parallel.context_mode=ring"}), "", "zaya_tsp2_ring"});
}
TEST(Tsp, Tsp2HybridRingMatchesOneRank) {
  expect_matches_single_rank({2, 1, joined(kHybrid, {"parallel.context_mode=ring"}), "", "hybrid_tsp2_ring"});
}
TEST(Tsp, Tsp2TimesDp2WithExpertParallelMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 2, {}, "", "tsp2_ep2"});
}
TEST(Tsp, Tsp2TimesDp2ZayaWithExpertParallelMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 2, kZaya, "", "zaya_tsp2_ep2"});
}

// tsp beside tp or cp, a model whose heads do not split, the all-to-all mode and sequence parallelism:
// each one clear error naming what to change.
TEST(Tsp, BadCombinationsAreOneClearError) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const fs::path dir = shared_dir("bad");
  struct Bad {
    mesh::Shape shape;
    std::vector<std::string> sets;
    std::string word;
  };
  mesh::Shape tsp_tp, tsp_cp, tsp2;
  tsp_tp.tsp = tsp_tp.tp = 2;
  tsp_cp.tsp = tsp_cp.cp = 2;
  tsp2.tsp = 2, tsp2.dp = 2, tsp2.zero = 1;
  mesh::Shape tsp4;
  tsp4.tsp = 4;
  for (const Bad& b : std::vector<Bad>{
           {tsp_tp, {"parallel.tensor=2", "parallel.tsp=2"}, "parallel.tsp (2) with parallel.tensor (2)"},
           {tsp_cp, {"parallel.context=2", "parallel.tsp=2"}, "parallel.tsp (2) with parallel.context (2)"},
           {tsp2, {"parallel.tsp=2", "parallel.context_mode=alltoall"}, "alltoall is context parallelism's"},
           {tsp4, joined(kZaya, {"parallel.tsp=4"}), "TSP over more ranks than CCA's 2 kv heads"},
           {tsp4, joined(widths_for(3), {"parallel.tsp=4"}),
            "does not split over tsp degree 4 (parallel.tsp)"}}) {
    TrainConfig cfg = config(dir, dir / "bad", b.sets);
    try {
      Trainer t(cfg, parallel::Mesh(b.shape, MPI_COMM_WORLD), true);
      ADD_FAILURE() << "accepted " << b.word;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(b.word), std::string::npos) << e.what();
    }
  }
}

// Trains to step 3 and saves under `save` (tsp=2, tp=2, or one rank alone: 0), resumes under
// `resume` and finishes: steps 4..6 match the uninterrupted run. A TSP rank's blocks are a
// tensor rank's, so its checkpoints resume at any degree of either.
enum class Layout { kOne, kTsp2, kTp2 };
void expect_resume(Layout save, Layout resume, const std::string& tag) {
  if (world_size() % 2) GTEST_SKIP();
  const fs::path dir = shared_dir(tag);
  const auto mesh_of = [&](Layout l) {
    return l == Layout::kOne ? parallel::Mesh() : l == Layout::kTsp2 ? tsp_mesh(2) : tsp_mesh(1, 1, 2);
  };
  const auto out = [&](const std::string& name, Layout l) {
    return l != Layout::kOne ? dir / name : dir / (name + std::to_string(world_rank()));
  };
  const auto cfg_of = [&](const std::string& name, Layout l, const std::vector<std::string>& sets) {
    std::vector<std::string> s = joined(kZaya, sets);
    s.insert(s.end(), {"steps=6", "batch.micro_batch=1", "batch.grad_accum=4"});
    if (l == Layout::kTsp2) s.push_back("parallel.tsp=2");
    if (l == Layout::kTp2) s.insert(s.end(), {"parallel.tensor=2", "parallel.sequence=true"});
    if (l != Layout::kOne) s.push_back("parallel.data=" + std::to_string(world_size() / 2));
    return config(dir, out(name, l), s, kMuon);
  };
  Trainer full(cfg_of("full", resume, {}), mesh_of(resume), true);
  const auto expect = full.run();
  TrainConfig first_cfg = cfg_of("first", save, {"checkpoint.interval=3"});
  {
    Trainer first(first_cfg, mesh_of(save), true);
    first.run(3);
    first.finish_checkpoint();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (save == Layout::kTsp2) {  // the saved layout names the axis
    bool named = false;
    for (const auto& e : fs::recursive_directory_iterator(first_cfg.checkpoint_dir))
      if (e.path().filename() == "metadata.json") {
        std::ifstream in(e.path());
        const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        named = named || text.find("tsp=2") != std::string::npos;
      }
    EXPECT_TRUE(named) << "no metadata.json under " << first_cfg.checkpoint_dir << " names tsp=2";
  }
  Trainer second(cfg_of("second", resume, {}), mesh_of(resume), true);
  second.resume(first_cfg.checkpoint_dir);
  ASSERT_EQ(second.step(), 3);
  const auto got = second.run();
  ASSERT_EQ(got.size(), 3u);
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i].loss, expect[i + 3].loss, 1e-5 * std::fabs(expect[i + 3].loss)) << tag << " step " << i + 4;
}

TEST(Tsp, CheckpointAtTsp2ResumesOnOneRank) { expect_resume(Layout::kTsp2, Layout::kOne, "resume_tsp2_1"); }
TEST(Tsp, CheckpointAtTsp2ResumesAtTp2) { expect_resume(Layout::kTsp2, Layout::kTp2, "resume_tsp2_tp2"); }
TEST(Tsp, CheckpointOfOneRankResumesAtTsp2) { expect_resume(Layout::kOne, Layout::kTsp2, "resume_1_tsp2"); }

// ---- on GPUs: one rank per GPU, the world one tsp group ----

using keel::test::gpu_per_rank;

// Sizes the CUDA kernels take (head_dim 64; chunks of 128 tokens: 2D chunks of 256 D tokens).
// The linear router's aux loss is off: on GPUs it is each rank's over its own tokens, as under
// context parallelism (docs/parallel.md).
const std::vector<std::string> kGpu = {"device=cuda",           "model.hidden=128",        "model.head_dim=64",
                                       "model.ffn_hidden=256",  "model.expert_hidden=128", "model.max_seq_len=1024",
                                       "router.aux_loss_weight=0", "router.log_counts=true"};

// d: the tsp degree (0: the world); sequences of 2 chunks of 128 tokens per rank of the group.
TrainConfig gpu_config(const fs::path& dir, const std::string& name, const std::vector<std::string>& model,
                       const std::vector<std::string>& more, const std::string& optimizer = "", int d = 0) {
  if (world_rank() == 0 && !fs::exists(dir / "d.idx")) fixtures::make_dataset(dir, "d", 600);
  std::vector<std::string> sets = joined(kGpu, model);
  sets.push_back("data.seq_length=" + std::to_string(2 * (d > 0 ? d : world_size()) * 128));
  sets.insert(sets.end(), more.begin(), more.end());
  return config(dir, dir / name, sets, optimizer);
}

// The first step against one GPU at bf16 tolerance, then training (group_compare_util.h).
// D: the tsp degree (0: the world), data parallel over the rest, expert parallel ep.
void expect_gpus_match_one_gpu(const std::vector<std::string>& model, const std::string& tag,
                               const std::string& optimizer = "", int D = 0, int ep = 1) {
  if (!gpu_per_rank()) GTEST_SKIP() << "needs a GPU per rank (" << visible_cuda_devices() << " visible)";
  if (D == 0) D = world_size();
  if (D == world_size() && tag.find("_dp") != std::string::npos) GTEST_SKIP() << "needs 2 data ranks (4 ranks or more)";
  if (tag.starts_with("zaya") && 2 % D != 0) GTEST_SKIP() << "CCA's 2 kv heads do not split over " << D << " ranks";
  keel::test::use_rank_gpu();
  const fs::path dir = shared_dir("gpu_" + tag);
  const TrainConfig cfg = gpu_config(
      dir, "tsp", model, {"steps=9", "parallel.tsp=" + std::to_string(D), "parallel.expert=" + std::to_string(ep)},
      optimizer, D);
  TrainConfig one = cfg;
  one.parallel_tsp = 1;
  one.parallel_expert = 1;
  one.output_dir = one.checkpoint_dir = (dir / ("single" + std::to_string(world_rank()))).string();
  // 2048 tokens a step: up to 1% of the routing slots may fall the other way of a near-tie
  // (rounding), and 9 steps at these sizes lower the tiny MoE's loss by less than 30%.
  fixtures::expect_gpu_group_matches_one_gpu(cfg, tsp_mesh(D, ep), one, tag, 0.01, 0.95);
}

TEST(Tsp, GpusMatchOneGpu) { expect_gpus_match_one_gpu({}, "tsp"); }
TEST(Tsp, GpusZayaMatchOneGpu) { expect_gpus_match_one_gpu(kZayaGpu, "zaya_tsp"); }
TEST(Tsp, GpusZayaWithMuonMatchOneGpu) { expect_gpus_match_one_gpu(kZayaGpu, "zaya_tsp_muon", kMuon); }
TEST(Tsp, GpusHybridMatchOneGpu) { expect_gpus_match_one_gpu(kHybrid, "hybrid_tsp"); }
// Each shard's k and v passed around the group (parallel.context_mode: ring): the tiny MoE and
// ZAYA1 (CCA).
TEST(Tsp, GpusRingMatchOneGpu) { expect_gpus_match_one_gpu({"parallel.context_mode=ring"}, "tsp_ring"); }
TEST(Tsp, GpusZayaRingMatchOneGpu) {
  expect_gpus_match_one_gpu(joined(kZayaGpu, {"parallel.context_mode=ring"}), "zaya_tsp_ring");
}
// The tables' rows stay and the tokens travel (parallel.tsp_tables: gather): untied, and ZAYA1's
// tied table with Muon.
TEST(Tsp, GpusGatheringTablesMatchOneGpu) { expect_gpus_match_one_gpu({"parallel.tsp_tables=gather"}, "tsp_gather"); }
TEST(Tsp, GpusZayaGatheringTablesWithMuonMatchOneGpu) {
  expect_gpus_match_one_gpu(joined(kZayaGpu, {"parallel.tsp_tables=gather"}), "zaya_tsp_gather_muon", kMuon);
}
// TSP=2 with data parallelism over the other ranks (ZeRO-1, the classic step): 4 ranks or more.
int tsp2_with_data() { return world_size() >= 4 && world_size() % 2 == 0 ? 2 : world_size(); }
TEST(Tsp, GpusZayaWithDataParallelMatchOneGpu) { expect_gpus_match_one_gpu(kZayaGpu, "zaya_tsp_dp", "", tsp2_with_data()); }
TEST(Tsp, GpusZayaWithDataParallelAndMuonMatchOneGpu) {
  expect_gpus_match_one_gpu(kZayaGpu, "zaya_tsp_dp_muon", kMuon, tsp2_with_data());
}
// ... and expert parallelism over the 2 data ranks (an expert runner per layer and weight shard).
TEST(Tsp, GpusWithExpertParallelMatchOneGpu) { expect_gpus_match_one_gpu({}, "tsp_dp_ep", "", tsp2_with_data(), 2); }
TEST(Tsp, GpusZayaWithExpertParallelAndMuonMatchOneGpu) {
  expect_gpus_match_one_gpu(kZayaGpu, "zaya_tsp_dp_ep_muon", kMuon, tsp2_with_data(), 2);
}

// A checkpoint the tsp group saves at step 2 reads back exactly on one GPU and at TP=2 (with
// sequence parallelism): the same elements through model::block_pieces; both then train on.
TEST(Tsp, GpuCheckpointsMoveToOneGpuAndTensorParallel) {
  if (!gpu_per_rank()) GTEST_SKIP() << "needs a GPU per rank (" << visible_cuda_devices() << " visible)";
  if (world_size() != 2) GTEST_SKIP() << "TP=2 needs 2 ranks";
  keel::test::use_rank_gpu();
  const fs::path dir = shared_dir("gpu_ckpt");
  const std::vector<std::string> sets = {"steps=4", "checkpoint.interval=2"};
  const TrainConfig group_cfg = gpu_config(dir, "group", kZayaGpu, joined(sets, {"parallel.tsp=2"}));
  TrainConfig one_cfg = gpu_config(dir, "one" + std::to_string(world_rank()), kZayaGpu, sets);
  TrainConfig tp_cfg = gpu_config(dir, "tp", kZayaGpu, joined(sets, {"parallel.tensor=2", "parallel.sequence=true"}));
  const parallel::Mesh mesh = tsp_mesh(2), tp = tsp_mesh(1, 1, 2);
  std::vector<float> saved;
  {
    Trainer g(group_cfg, mesh, true);
    g.run(2);
    g.finish_checkpoint();
    saved = g.backend().state().params;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Trainer o(one_cfg, parallel::Mesh(), true);
  o.resume(group_cfg.checkpoint_dir);
  ASSERT_EQ(o.step(), 2);
  {
    Trainer g(group_cfg, mesh, true);  // the layout of the saved blocks
    EXPECT_EQ(fixtures::max_rel_diff(g.backend().layout(), saved, mesh, o.backend().layout(), o.backend().state().params),
              0.0);
  }
  Trainer t(tp_cfg, tp, true);
  t.resume(group_cfg.checkpoint_dir);
  ASSERT_EQ(t.step(), 2);
  EXPECT_EQ(fixtures::max_rel_diff(t.backend().layout(), t.backend().state().params, tp, o.backend().layout(),
                                   o.backend().state().params),
            0.0);
  const auto more = t.run();
  ASSERT_EQ(more.size(), 2u);
  EXPECT_TRUE(std::isfinite(more.back().loss));
  const auto alone = o.run();
  ASSERT_EQ(alone.size(), 2u);
  EXPECT_NEAR(more.back().loss, alone.back().loss, 0.05 * alone.back().loss);
}

}  // namespace
}  // namespace keel::train

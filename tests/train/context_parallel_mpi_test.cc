// keel train with context parallelism on CPU ranks under MPI (run at 2, 3 and 4 ranks): each
// sequence's 24 tokens split over C ranks (zigzag chunks), alone (C = the world), with data
// parallelism + ZeRO-1 (C=2 x DP=2), with expert parallelism (EP folded over the C ranks) and with
// tensor parallelism (C=2 x TP=2), matches the one-rank run of the same global batch within 1e-5
// relative per step for 20 steps: on the tests' tiny MoE (gqa, linear top-2 router with its aux
// and z losses and the balancing bias) and on a ZAYA1-shaped tiny model (CCA, whose convolutions
// and value shift read across chunk and rank boundaries, the MLP router with the skip class,
// residual scaling), with AdamW and with Muon; plus a sliding-window layer. Checkpoints move
// between context degrees both ways. The ring mode matches as well. A sequence that does not
// split is one clear error. On GPUs
// (a GPU per rank, the world one context group; skipped otherwise): C = the world against one
// GPU at bf16 tolerance, on the tiny MoE and the ZAYA1-shaped model.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "common/error.h"
#include "device/cuda_devices.h"
#include "train/trainer.h"
#include "group_compare_util.h"
#include "train_mpi_test_util.h"
#include "train_test_util.h"
#include "world_run_util.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;
using keel::test::world_rank;
using keel::test::world_size;

fs::path shared_dir(const std::string& name) { return keel::test::shared_temp_dir("cp_mpi", name); }

parallel::Mesh cp_mesh(int cp, int tp = 1, int ep = 1) {
  mesh::Shape s;
  s.cp = cp;
  s.tp = tp;
  s.dp = world_size() / (cp * tp);
  s.ep = ep;
  s.zero = s.dp * s.cp > 1 ? 1 : 0;
  return parallel::Mesh(s, MPI_COMM_WORLD);
}

using fixtures::joined;
using fixtures::kHybrid;
using fixtures::kLinear;
using fixtures::kSliding;
using fixtures::kZaya;
using fixtures::kZayaGpu;

TrainConfig config(const fs::path& dir, const fs::path& out, const std::vector<std::string>& extra,
                   const std::string& optimizer_extra = "") {
  return fixtures::world_config(dir, out, extra, optimizer_extra, "cp.yaml");
}

struct Case {
  int cp = 2, tp = 1, ep = 1;
  std::vector<std::string> sets;
  std::string optimizer;
  std::string tag;
};

void expect_matches_single_rank(const Case& c) {
  if (world_size() % (c.cp * c.tp) != 0) GTEST_SKIP() << "cp x tp does not divide " << world_size();
  const int dp = world_size() / (c.cp * c.tp);
  if ((dp * c.cp) % c.ep != 0) GTEST_SKIP() << "ep does not divide dp x cp";
  const fs::path dir = shared_dir(c.tag);
  std::vector<std::string> sets = c.sets;
  sets.push_back("parallel.context=" + std::to_string(c.cp));
  if (c.tp > 1) sets.insert(sets.end(), {"parallel.tensor=" + std::to_string(c.tp), "parallel.sequence=true"});
  if (c.ep > 1) sets.push_back("parallel.expert=" + std::to_string(c.ep));
  // With data parallelism, micro-batches of one sequence (the linear router's aux loss is per
  // micro-batch); the context ranks share theirs, so any micro-batch size works for them.
  if (dp > 1) sets.insert(sets.end(), {"batch.micro_batch=1", "batch.grad_accum=" + std::to_string(4 * dp)});
  TrainConfig cfg = config(dir, dir / "cp", sets, c.optimizer);
  const parallel::Mesh mesh = cp_mesh(c.cp, c.tp, c.ep);
  Trainer t(cfg, mesh, true);
  TrainConfig one = cfg;
  one.parallel_context = one.parallel_tensor = one.parallel_expert = 1;
  one.model_options.sequence_parallel = false;
  one.output_dir = one.checkpoint_dir = (dir / ("single" + std::to_string(world_rank()))).string();
  Trainer single(one, parallel::Mesh(), true);
  const auto got = t.run();  // collective: before the one-rank run, on every rank
  const auto want = single.run();
  fixtures::expect_same_steps(got, want, c.tag);
  if (c.tp == 1 && c.ep == 1) {  // every rank holds the whole model
    const auto& a = t.backend().state().params;
    const auto& b = single.backend().state().params;
    ASSERT_EQ(a.size(), b.size());
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      num = std::max(num, std::fabs(double(a[i]) - b[i]));
      den = std::max(den, std::fabs(double(b[i])));
    }
    EXPECT_LT(num / den, 5e-5) << c.tag;
  }
}

const std::string& kMuon = fixtures::kMuonOptimizer;

TEST(ContextParallel, WorldMatchesOneRank) { expect_matches_single_rank({world_size(), 1, 1, {}, "", "cpN"}); }
// By heads (parallel.context_mode: alltoall): each rank attends over whole sequences of 1/C of
// the heads. The tiny MoE with 4 kv heads (MHA: C = 2 or 4), ZAYA1's CCA (4 query, 2 kv heads:
// C = 2) with Muon, the LASP-2H hybrid (its linear layer by heads too) and C=2 x DP=2 with EP.
const std::vector<std::string> kAllToAll = {"parallel.context_mode=alltoall"};
TEST(ContextParallel, WorldAllToAllMatchesOneRank) {
  if (4 % world_size() != 0) GTEST_SKIP() << "4 heads do not split over " << world_size() << " ranks";
  expect_matches_single_rank({world_size(), 1, 1, joined(kAllToAll, {"model.kv_heads=4"}), "", "a2a_cpN"});
}
TEST(ContextParallel, Cp2ZayaAllToAllWithMuonMatchesOneRank) {
  expect_matches_single_rank({2, 1, 1, joined(kZaya, kAllToAll), kMuon, "zaya_a2a_cp2"});
}
TEST(ContextParallel, Cp2HybridAllToAllMatchesOneRank) {
  expect_matches_single_rank({2, 1, 1, joined(kHybrid, kAllToAll), "", "hybrid_a2a_cp2"});
}
TEST(ContextParallel, Cp2LinearAllToAllMatchesOneRank) {
  expect_matches_single_rank({2, 1, 1, joined(kLinear, kAllToAll), "", "linear_a2a_cp2"});
}
// ... and with tensor parallelism (+ SP): each tensor rank's heads split again over the context ranks.
TEST(ContextParallel, Cp2TimesTp2AllToAllMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 2, 1, joined(kAllToAll, {"model.kv_heads=4"}), "", "a2a_cp2tp2"});
}
TEST(ContextParallel, Cp2TimesDp2AllToAllWithExpertParallelMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 1, 2, joined(kZaya, kAllToAll), "", "zaya_a2a_cp2dp2ep2"});
}
TEST(ContextParallel, WorldZayaMatchesOneRank) {
  expect_matches_single_rank({world_size(), 1, 1, kZaya, "", "zaya_cpN"});
  // With the MLP router's aux loss on: its class shares are the micro-batch's (summed over the
  // context group), its gradient each rank's share.
  expect_matches_single_rank({world_size(), 1, 1, fixtures::kZayaAux, "", "zaya_aux_cpN"});
}
TEST(ContextParallel, WorldZayaSlidingWithMuonMatchesOneRank) {
  expect_matches_single_rank({world_size(), 1, 1, joined(kZaya, kSliding), kMuon, "zaya_sliding_cpN"});
}
// The ring (parallel.context_mode: ring): k, v blocks travel around the group instead of being
// all-gathered (and linear layers pass their states rank to rank, LASP-1); the tiny MoE, ZAYA1's
// CCA with a sliding window, a linear model, and the hybrid.
TEST(ContextParallel, WorldRingMatchesOneRank) {
  expect_matches_single_rank({world_size(), 1, 1, {"parallel.context_mode=ring"}, "", "ring_cpN"});
}
TEST(ContextParallel, WorldZayaSlidingRingMatchesOneRank) {
  expect_matches_single_rank(
      {world_size(), 1, 1, joined(joined(kZaya, kSliding), {"parallel.context_mode=ring"}), "", "zaya_ring_cpN"});
}
TEST(ContextParallel, WorldLinearRingMatchesOneRank) {  // LASP-1
  expect_matches_single_rank({world_size(), 1, 1, joined(kLinear, {"parallel.context_mode=ring"}), "", "linear_ring_cpN"});
}
TEST(ContextParallel, Cp2TimesDp2HybridRingMatchesOneRank) {
  expect_matches_single_rank({2, 1, 1, joined(kHybrid, {"parallel.context_mode=ring"}), "", "hybrid_ring_cp2dp"});
}
// LASP-2: linear attention's runs start from the gathered, prefix-summed states of the chunks
// before them (one all-gather per layer each way); LASP-2H: a hybrid's softmax layers over the
// same axis gather k and v.
TEST(ContextParallel, WorldLinearMatchesOneRank) {
  expect_matches_single_rank({world_size(), 1, 1, kLinear, "", "linear_cpN"});
}
TEST(ContextParallel, WorldHybridWithMuonMatchesOneRank) {
  expect_matches_single_rank({world_size(), 1, 1, kHybrid, kMuon, "hybrid_cpN"});
}
TEST(ContextParallel, Cp2TimesDp2LinearMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 1, 1, kLinear, "", "linear_cp2dp2"});
}
TEST(ContextParallel, Cp2TimesTp2HybridMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 2, 1, kHybrid, "", "hybrid_cp2tp2"});
}
TEST(ContextParallel, Cp2HybridWithExpertParallelMatchesOneRank) {
  expect_matches_single_rank({2, 1, 2, kHybrid, "", "hybrid_cp2ep2"});
}

TEST(ContextParallel, Cp2WithExpertParallelMatchesOneRank) {
  expect_matches_single_rank({2, 1, 2, {}, kMuon, "cp2ep2"});
}
TEST(ContextParallel, Cp2ZayaWithExpertParallelMatchesOneRank) {
  expect_matches_single_rank({2, 1, 2, kZaya, "", "zaya_cp2ep2"});
}
TEST(ContextParallel, Cp2TimesDp2MatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 1, 1, kZaya, "", "zaya_cp2dp2"});
}
TEST(ContextParallel, Cp2TimesDp2WithExpertParallelMatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 1, 4, {}, "", "cp2dp2ep4"});
}
TEST(ContextParallel, Cp2TimesTp2MatchesOneRank) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_matches_single_rank({2, 2, 1, kZaya, kMuon, "zaya_cp2tp2"});
}

// A sequence that does not split into 2C chunks (or chunks shorter than CCA's halo): one clear
// error naming the config and parallel.context, before any work.
TEST(ContextParallel, SequenceThatDoesNotSplitIsOneClearError) {
  if (world_size() % 2 != 0) GTEST_SKIP();
  const fs::path dir = shared_dir("bad");
  for (const auto& [sets, word] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"data.seq_length=22"}, "does not split over context-parallel degree 2"},
           {joined(kZaya, {"data.seq_length=4", "model.cca_conv_width=3"}), "fewer than the 3"},
           // by heads, one kv head does not split over 2 ranks
           {{"parallel.context_mode=alltoall", "model.heads=2", "model.kv_heads=1"},
            "parallel.context_mode: alltoall splits each layer's heads over the 2 context ranks"}}) {
    std::vector<std::string> s = sets;
    s.push_back("parallel.context=2");
    TrainConfig cfg = config(dir, dir / "bad", s);
    try {
      Trainer t(cfg, cp_mesh(2), true);
      ADD_FAILURE() << "accepted " << word;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  }
}

// Trains to step 3 and saves at context degree `save_cp` (0: one rank alone), resumes at
// `resume_cp` (0: one rank) and finishes: steps 4..6 match the uninterrupted run.
void expect_resume(int save_cp, int resume_cp, const std::string& tag) {
  if ((save_cp > 0 && world_size() % save_cp) || (resume_cp > 0 && world_size() % resume_cp)) GTEST_SKIP();
  const fs::path dir = shared_dir(tag);
  const auto mesh_of = [&](int cp) { return cp > 0 ? cp_mesh(cp) : parallel::Mesh(); };
  const auto out = [&](const std::string& name, int cp) {
    return cp > 0 ? dir / name : dir / (name + std::to_string(world_rank()));
  };
  const auto cfg_of = [&](const std::string& name, int cp, const std::vector<std::string>& sets) {
    std::vector<std::string> s = joined(kZaya, sets);
    s.insert(s.end(), {"steps=6", "batch.micro_batch=1", "batch.grad_accum=4"});
    if (cp > 1) s.push_back("parallel.context=" + std::to_string(cp));
    if (cp > 0) s.push_back("parallel.data=" + std::to_string(world_size() / cp));
    return config(dir, out(name, cp), s, kMuon);
  };
  Trainer full(cfg_of("full", resume_cp, {}), mesh_of(resume_cp), true);
  const auto expect = full.run();
  TrainConfig first_cfg = cfg_of("first", save_cp, {"checkpoint.interval=3"});
  {
    Trainer first(first_cfg, mesh_of(save_cp), true);
    first.run(3);
    first.finish_checkpoint();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Trainer second(cfg_of("second", resume_cp, {}), mesh_of(resume_cp), true);
  second.resume(first_cfg.checkpoint_dir);
  ASSERT_EQ(second.step(), 3);
  const auto got = second.run();
  ASSERT_EQ(got.size(), 3u);
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i].loss, expect[i + 3].loss, 1e-5 * std::fabs(expect[i + 3].loss)) << tag << " step " << i + 4;
}

TEST(ContextParallel, CheckpointAtCp2ResumesOnOneRank) { expect_resume(2, 0, "resume_cp2_1"); }
TEST(ContextParallel, CheckpointOfOneRankResumesAtCp2) { expect_resume(0, 2, "resume_1_cp2"); }

// ---- on GPUs: one rank per GPU, the world one context group ----

using keel::test::gpu_per_rank;

// Sizes the CUDA kernels take (head_dim 64; chunks of 128 tokens: 2C chunks of 512 / (2C)).
const std::vector<std::string> kGpu = {"device=cuda",           "model.hidden=128",      "model.head_dim=64",
                                       "model.ffn_hidden=256",  "model.expert_hidden=128", "model.max_seq_len=1024",
                                       "router.aux_loss_weight=0"};

// GPU runs agree with one GPU to bf16 rounding (attention sums its keys in another order, dk and
// dv are summed over the ranks): the first step's loss and gradient norm, the same routing (to
// near-ties); then
// 8 steps must learn alike, and every parameter (replicated over the context ranks) must hold the
// same bits on every rank. The linear router's aux loss is off: on GPUs it is each rank's over
// its own tokens (docs/parallel.md), not the one-GPU micro-batch's.
// tp > 1: C = world / tp, tensor parallel (with sequence parallelism) over tp ranks. drift: the
// step-9 loss's relative tolerance.
void expect_gpus_match_one_gpu(const std::vector<std::string>& model, const std::string& tag, int seq = 0, int ep = 1,
                               int tp = 1, double drift = 0.05) {
  if (!gpu_per_rank()) GTEST_SKIP() << "needs a GPU per rank (" << visible_cuda_devices() << " visible)";
  if (world_size() % tp != 0 || world_size() / tp < 2) GTEST_SKIP() << "needs 2 context ranks of tensor degree " << tp;
  keel::test::use_rank_gpu();
  const int C = world_size() / tp;
  if (seq == 0) seq = 2 * C * 128;
  const fs::path dir = shared_dir("gpu_" + tag);
  if (world_rank() == 0) fixtures::make_dataset(dir, "d", 600);
  std::vector<std::string> sets = joined(kGpu, model);
  sets.insert(sets.end(), {"steps=9", "router.log_counts=true", "data.seq_length=" + std::to_string(seq),
                           "parallel.context=" + std::to_string(C), "parallel.expert=" + std::to_string(ep)});
  if (tp > 1) sets.insert(sets.end(), {"parallel.tensor=" + std::to_string(tp), "parallel.sequence=true"});
  TrainConfig cfg = config(dir, dir / "cp", sets);
  Trainer t(cfg, cp_mesh(C, tp, ep), true);
  TrainConfig one = cfg;
  one.parallel_context = one.parallel_expert = one.parallel_tensor = 1;
  one.model_options.sequence_parallel = false;
  one.output_dir = one.checkpoint_dir = (dir / ("single" + std::to_string(world_rank()))).string();
  Trainer single(one, parallel::Mesh(), true);
  // the context core's buffers (the gathers, or the ring's and all-to-all's, allocated when the
  // mode is chosen for the widest layer: parallel/context_mode.h) never grow during training
  const auto context_bytes = [&] {
    std::size_t b = 0;
    for (const auto& it : t.backend().memory_breakdown())
      if (it.name.rfind("context-parallel", 0) == 0) b += it.bytes;
    return b;
  };
  const std::size_t context_at_start = context_bytes();
  const StepStats a = t.run(1).at(0), b = single.run(1).at(0);
  EXPECT_NEAR(a.loss, b.loss, 2e-3 * std::fabs(b.loss)) << tag;
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 2e-2 * b.grad_norm) << tag;
  // the same routing, but for near-ties (rounding): at most 1% of the slots elsewhere (at 4
  // ranks one of 8,192 slots moved; ZAYA1 at C=2 x TP=2, 5 of 2,048)
  fixtures::expect_routing_close(a, b, 1e-2, tag);
  const auto rest = t.run(), single_rest = single.run();
  ASSERT_EQ(rest.size(), 8u);
  EXPECT_LT(rest.back().loss, 0.95 * a.loss) << tag << ": learns";
  if (world_rank() == 0)
    std::printf("  %s: step 9 loss %.4f at context degree %d, %.4f on one GPU\n", tag.c_str(), rest.back().loss, C,
                single_rest.back().loss);
  EXPECT_NEAR(rest.back().loss, single_rest.back().loss, drift * single_rest.back().loss) << tag;
  EXPECT_EQ(context_bytes(), context_at_start) << tag << ": the context-parallel buffers grew during training";
  if (ep > 1 || tp > 1) return;  // each rank holds other experts, or other blocks
  std::vector<float> mine = t.backend().state().params, root = mine;
  MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(mine, root) << tag << ": the parameters differ between context ranks";
}

TEST(ContextParallel, GpusMatchOneGpu) { expect_gpus_match_one_gpu({}, "cp"); }
TEST(ContextParallel, GpusZayaMatchOneGpu) { expect_gpus_match_one_gpu(kZayaGpu, "zaya_cp"); }
// LASP-2 on GPUs: all layers linear (decayed, elu+1; chunks of 128 tokens span two of the
// kernels' 64-token chunks), and the LASP-2H hybrid (a linear and a softmax layer).
TEST(ContextParallel, GpusLinearMatchOneGpu) {
  expect_gpus_match_one_gpu({"model.attention=linear", "model.linear_feature=elu1", "model.linear_decay=retnet"},
                            "linear_cp");
}
TEST(ContextParallel, GpusHybridMatchOneGpu) { expect_gpus_match_one_gpu(kHybrid, "hybrid_cp"); }
// LASP-1 on GPUs (parallel.context_mode: ring, all layers linear): the states passed rank to
// rank; against one GPU as above, and against LASP-2's all-gather on the same ranks: the same
// chunk walk in the same order, so the first step agrees to fp32 rounding.
const std::vector<std::string> kLinearGpu = {"model.attention=linear", "model.linear_feature=elu1",
                                             "model.linear_decay=retnet"};
TEST(ContextParallel, GpusLinearRingMatchOneGpu) {
  expect_gpus_match_one_gpu(joined(kLinearGpu, {"parallel.context_mode=ring"}), "linear_ring_cp");
}
TEST(ContextParallel, GpusLinearRingMatchesAllGather) {
  if (!gpu_per_rank()) GTEST_SKIP() << "needs a GPU per rank (" << visible_cuda_devices() << " visible)";
  keel::test::use_rank_gpu();
  const int C = world_size();
  const fs::path dir = shared_dir("gpu_linear_ring_vs_gather");
  if (world_rank() == 0) fixtures::make_dataset(dir, "d", 600);
  std::vector<std::string> sets = joined(kGpu, kLinearGpu);
  sets.insert(sets.end(), {"steps=3", "data.seq_length=" + std::to_string(2 * C * 128), "parallel.context=" + std::to_string(C)});
  const TrainConfig gather = config(dir, dir / "gather", sets);
  const TrainConfig ring = config(dir, dir / "ring", joined(sets, {"parallel.context_mode=ring"}));
  Trainer a(gather, cp_mesh(C, 1, 1), true), b(ring, cp_mesh(C, 1, 1), true);
  const auto sa = a.run(), sb = b.run();
  ASSERT_EQ(sa.size(), 3u);
  ASSERT_EQ(sb.size(), 3u);
  for (std::size_t i = 0; i < sa.size(); ++i) {
    EXPECT_NEAR(sb[i].loss, sa[i].loss, 1e-5 * std::fabs(sa[i].loss)) << "step " << i + 1;
    EXPECT_NEAR(sb[i].grad_norm, sa[i].grad_norm, 1e-4 * sa[i].grad_norm) << "step " << i + 1;
  }
}
// By heads on GPUs (parallel.context_mode: alltoall, context_alltoall_cuda.cc): the tiny MoE with
// 4 kv heads (C = 2 or 4), ZAYA1's CCA (4 query / 2 kv heads: C = 2), the LASP-2H hybrid and an
// all-linear model (their linear layers by heads too), and C = 2 x TP = 2 (4 ranks).
TEST(ContextParallel, GpusAllToAllMatchOneGpu) {
  if (4 % world_size() != 0) GTEST_SKIP() << "4 heads do not split over " << world_size() << " ranks";
  expect_gpus_match_one_gpu(joined(kAllToAll, {"model.kv_heads=4"}), "a2a_cp");
}
TEST(ContextParallel, GpusZayaAllToAllMatchOneGpu) {
  if (world_size() != 2) GTEST_SKIP() << "ZAYA1-tiny's 2 kv heads split over 2 ranks";
  expect_gpus_match_one_gpu(joined(kZayaGpu, kAllToAll), "zaya_a2a_cp");
}
TEST(ContextParallel, GpusHybridAllToAllMatchOneGpu) {
  if (world_size() != 2) GTEST_SKIP() << "the hybrid's 2 kv heads split over 2 ranks";
  expect_gpus_match_one_gpu(joined(kHybrid, kAllToAll), "hybrid_a2a_cp");
}
TEST(ContextParallel, GpusLinearAllToAllMatchOneGpu) {
  if (world_size() != 2) GTEST_SKIP() << "2 kv heads split over 2 ranks";
  expect_gpus_match_one_gpu(joined(kLinearGpu, kAllToAll), "linear_a2a_cp");
}
TEST(ContextParallel, GpusAllToAllWithTensorParallelMatchOneGpu) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_gpus_match_one_gpu(joined(kAllToAll, {"model.kv_heads=4"}), "a2a_cp_tp", 0, 1, 2);
}
// The k/v ring on GPUs (parallel.context_mode: ring, context_ring_cuda.cc): the tiny MoE, ZAYA1's
// CCA (with a sliding-window layer), the LASP-2H hybrid (its linear layer by LASP-1) at C = world
// size; and its first steps against the all-gather's on the same ranks (the same sums in
// another order and the blocks' outputs rounded to bf16 before the merge: bf16 tolerances).
const std::vector<std::string> kRing = {"parallel.context_mode=ring"};
TEST(ContextParallel, GpusRingMatchOneGpu) { expect_gpus_match_one_gpu(kRing, "ring_cp"); }
TEST(ContextParallel, GpusZayaRingMatchOneGpu) { expect_gpus_match_one_gpu(joined(kZayaGpu, kRing), "zaya_ring_cp"); }
TEST(ContextParallel, GpusZayaSlidingRingMatchOneGpu) {
  expect_gpus_match_one_gpu(
      joined(kZayaGpu, {"model.layer_sliding=[false, true]", "model.sliding_window=200", "parallel.context_mode=ring"}),
      "zaya_sliding_ring_cp");
}
// The hybrid's trajectory at this toy size amplifies the ring's other summation order (the merge,
// the backward's fp32 atomics): against the all-gather on the same 2 ranks its step-9 gradient
// norm came 0.28 against 0.67 while the losses agreed to 0.2%. Its step-9 loss against one GPU
// came 0.07% (C = 2) and 0.14% (C = 4) off with the blocks merged in fp32; while the blocks were
// rounded to bf16 first, 0.7% and 7% in two runs at C = 2. Hence 10% here; the first step is
// checked as tightly as everywhere.
TEST(ContextParallel, GpusHybridRingMatchOneGpu) {
  expect_gpus_match_one_gpu(joined(kHybrid, kRing), "hybrid_ring_cp", 0, 1, 1, 0.1);
}
void expect_ring_matches_all_gather(const std::vector<std::string>& model, const std::string& tag) {
  if (!gpu_per_rank()) GTEST_SKIP() << "needs a GPU per rank (" << visible_cuda_devices() << " visible)";
  keel::test::use_rank_gpu();
  const int C = world_size();
  const fs::path dir = shared_dir("gpu_ring_vs_gather_" + tag);
  if (world_rank() == 0) fixtures::make_dataset(dir, "d", 600);
  std::vector<std::string> sets = joined(kGpu, model);
  sets.insert(sets.end(), {"steps=9", "data.seq_length=" + std::to_string(2 * C * 128), "parallel.context=" + std::to_string(C)});
  const TrainConfig gather = config(dir, dir / "gather", sets);
  const TrainConfig ring = config(dir, dir / "ring", joined(sets, kRing));
  Trainer a(gather, cp_mesh(C, 1, 1), true), b(ring, cp_mesh(C, 1, 1), true);
  const auto sa = a.run(), sb = b.run();
  ASSERT_EQ(sa.size(), 9u);
  ASSERT_EQ(sb.size(), 9u);
  for (std::size_t i = 0; i < sa.size(); ++i) {
    if (world_rank() == 0)
      std::printf("  %s step %zu: loss %.6f (ring) %.6f (all-gather), grad norm %.5f %.5f\n", tag.c_str(), i + 1,
                  sb[i].loss, sa[i].loss, sb[i].grad_norm, sa[i].grad_norm);
    if (i >= 3) continue;  // later steps drift apart by training on slightly different numbers
    EXPECT_NEAR(sb[i].loss, sa[i].loss, 2e-3 * std::fabs(sa[i].loss)) << tag << " step " << i + 1;
    EXPECT_NEAR(sb[i].grad_norm, sa[i].grad_norm, 2e-2 * sa[i].grad_norm) << tag << " step " << i + 1;
  }
}
TEST(ContextParallel, GpusRingMatchesAllGather) { expect_ring_matches_all_gather(kZayaGpu, "zaya"); }
TEST(ContextParallel, GpusHybridRingMatchesAllGather) { expect_ring_matches_all_gather(kHybrid, "hybrid"); }
// Expert parallelism folded over the context ranks: each GPU holds half of the experts.
TEST(ContextParallel, GpusZayaWithExpertParallelMatchOneGpu) {
  expect_gpus_match_one_gpu(kZayaGpu, "zaya_cp_ep", 0, world_size());
}
// C = 2 x TP = 2 with sequence parallelism (4 ranks).
TEST(ContextParallel, GpusWithTensorParallelMatchOneGpu) { expect_gpus_match_one_gpu({}, "cp_tp", 0, 1, 2); }
TEST(ContextParallel, GpusZayaWithTensorParallelMatchOneGpu) { expect_gpus_match_one_gpu(kZayaGpu, "zaya_cp_tp", 0, 1, 2); }
TEST(ContextParallel, GpusZayaSlidingMatchOneGpu) {
  expect_gpus_match_one_gpu(joined(kZayaGpu, {"model.layer_sliding=[false, true]", "model.sliding_window=200"}),
                            "zaya_sliding_cp");
}

}  // namespace
}  // namespace keel::train

// keel train data parallel with ZeRO-1 on CPU ranks under MPI (run at 2, 3 and 4 ranks): a run
// on N ranks matches the 1-rank run of the same global batch within fp32-reduction tolerance
// (AdamW, and Muon with whole matrices owned by ranks); the optimizer shards tile the flat
// buffer; checkpoints saved at N ranks resume at 1 and at N, and 1-rank checkpoints resume at
// N, continuing as the uninterrupted run; a batch that does not split over the ranks is
// refused on every rank alike.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "common/error.h"
#include "device/cuda_devices.h"
#include "parallel/zero1.h"
#include "train/trainer.h"
#include "train_mpi_test_util.h"
#include "train_test_util.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;
using keel::test::world_rank;
using keel::test::world_size;

fs::path shared_dir(const std::string& name) { return keel::test::shared_temp_dir("dp_mpi", name); }

// The shared tiny config with 12 micro-batches of 1 sequence per step (splits over 1..4 ranks
// and 6 and 12), on a dataset rank 0 writes.
TrainConfig config(const fs::path& dir, const fs::path& out, const std::vector<std::string>& extra = {},
                   const std::string& optimizer_extra = "") {
  if (world_rank() == 0 && !fs::exists(dir / "d.idx")) fixtures::make_dataset(dir, "d");
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> sets = {"batch.micro_batch=1", "batch.grad_accum=12", "steps=8"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_train_config(fixtures::train_config_text((dir / "d").string(), out, optimizer_extra), "dp.yaml", sets);
}

using fixtures::world_context;
const std::string& kMuon = fixtures::kMuonOptimizer;

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) num = std::max(num, std::fabs(double(a[i]) - b[i])), den = std::max(den, std::fabs(double(b[i])));
  return den > 0 ? num / den : num;
}

void expect_matches_single_rank(const std::string& optimizer_extra, const std::string& tag,
                                const std::vector<std::string>& extra = {}) {
  const fs::path dir = shared_dir(tag);
  std::vector<std::string> sets = {"checkpoint.final=false"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  TrainConfig cfg = config(dir, dir / "dp", sets, optimizer_extra);
  Trainer dp(cfg, world_context(), true);
  const auto dp_stats = dp.run();
  // The reference: this process alone over the same 12 micro-batches per step.
  TrainConfig one = cfg;
  one.output_dir = one.checkpoint_dir = (dir / ("single" + std::to_string(world_rank()))).string();
  Trainer single(one, parallel::Mesh(), true);
  const auto single_stats = single.run();
  ASSERT_EQ(dp_stats.size(), single_stats.size());
  for (std::size_t i = 0; i < dp_stats.size(); ++i) {
    EXPECT_NEAR(dp_stats[i].loss, single_stats[i].loss, 1e-5 * std::fabs(single_stats[i].loss)) << tag << " step " << i + 1;
    EXPECT_NEAR(dp_stats[i].grad_norm, single_stats[i].grad_norm, 1e-4 * single_stats[i].grad_norm) << tag << " step " << i + 1;
  }
  EXPECT_LT(max_rel_diff(dp.backend().state().params, single.backend().state().params), 2e-5) << tag;
  // every rank holds the same parameters (the all-gather): rank 0's checksum everywhere
  double sum = 0;
  for (float x : dp.backend().state().params) sum += x;
  double root = sum;
  MPI_Bcast(&root, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  EXPECT_EQ(sum, root) << tag;
}

TEST(DataParallel, MatchesOneRankWithAdamW) { expect_matches_single_rank("", "adamw"); }

TEST(DataParallel, MatchesOneRankWithMuon) { expect_matches_single_rank(kMuon, "muon"); }

// Issue 34: rank r takes every dp-th sample of the step (data::BatchLoader), so with micro_batch
// above 1 its micro-batches group other sequences than the 1-rank run's. Every loss term but the
// linear router's aux loss is a mean over tokens (the same over any grouping of equal
// micro-batches); the aux loss, E * sum_e f_e P_e per micro-batch, is not. Without it (the z-loss
// and bias balancing on) N ranks match one rank at micro_batch 2 as at micro_batch 1
// (docs/parallel.md says when runs at different rank counts match).
TEST(DataParallel, MatchesOneRankWithSeveralSequencesPerMicroBatchWithoutAuxLoss) {
  expect_matches_single_rank("", "mb2_no_aux", {"batch.micro_batch=2", "router.aux_loss_weight=0"});
}

// The other half of that claim: with the aux loss on and micro_batch 2, the first step's
// cross-entropy is the 1-rank run's (the same parameters, the same tokens) but its aux loss is
// not (other micro-batches). Should the ranks come to take the 1-rank run's micro-batches
// (contiguous slices of each global batch), this fails: then docs/parallel.md can say that runs
// at any rank count match.
TEST(DataParallel, AuxLossDependsOnTheRankCountWithSeveralSequencesPerMicroBatch) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2+ ranks";
  const fs::path dir = shared_dir("mb2_aux");
  TrainConfig cfg = config(dir, dir / "dp", {"checkpoint.final=false", "batch.micro_batch=2", "steps=2"});
  Trainer dp(cfg, world_context(), true);
  const auto a = dp.run();
  TrainConfig one = cfg;
  one.output_dir = one.checkpoint_dir = (dir / ("single" + std::to_string(world_rank()))).string();
  Trainer single(one, parallel::Mesh(), true);
  const auto b = single.run();
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_NEAR(a[0].ce, b[0].ce, 1e-5 * std::fabs(b[0].ce));
  EXPECT_NEAR(a[0].z, b[0].z, 1e-5 * std::fabs(b[0].z)) << "the z-loss is a mean over tokens";
  EXPECT_GT(std::fabs(a[0].aux - b[0].aux), 2e-6 * std::fabs(b[0].aux))  // fp32 rounding: about 1e-7
      << "the aux loss of " << world_size() << " ranks equals one rank's (" << a[0].aux
      << "): the ranks take the 1-rank run's micro-batches; update docs/parallel.md";
  if (world_rank() == 0)
    std::printf("  micro_batch 2 on %d ranks: step 1 aux %.6f vs %.6f on one rank, ce %.6f vs %.6f\n", world_size(),
                a[0].aux, b[0].aux, a[0].ce, b[0].ce);
}

// parallel.grad_reduce: bf16 sums the gradients in bf16 (DataParallelComm's own test checks the
// rounding exactly): the run differs from the fp32 one (the setting reaches the comm) by no
// more than bf16 gradients make it.
TEST(DataParallel, Bf16GradientReduceTrainsLikeFp32) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2+ ranks";
  const fs::path dir = shared_dir("bf16_reduce");
  Trainer fp32(config(dir, dir / "fp32", {"checkpoint.final=false"}), world_context(), true);
  Trainer bf16(config(dir, dir / "bf16", {"checkpoint.final=false", "parallel.grad_reduce=bf16"}), world_context(), true);
  const auto a = fp32.run(), b = bf16.run();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(a[0].loss, b[0].loss) << "the same first forward";
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(b[i].loss, a[i].loss, 1e-2 * std::fabs(a[i].loss)) << "step " << i + 1;
    EXPECT_NEAR(b[i].grad_norm, a[i].grad_norm, 2e-2 * a[i].grad_norm) << "step " << i + 1;
  }
  const auto pa = fp32.backend().state().params, pb = bf16.backend().state().params;
  EXPECT_NE(pa, pb) << "bf16 reduction trained bit for bit as fp32";
  const double d = max_rel_diff(pb, pa);
  EXPECT_LT(d, 2e-2);
  if (world_rank() == 0)
    std::printf("  bf16 gradient reduce on %d ranks: step 1 grad norm %.6f vs %.6f (fp32), step 8 loss %.6f vs %.6f, "
                "parameters %.2e apart\n",
                world_size(), b[0].grad_norm, a[0].grad_norm, b.back().loss, a.back().loss, d);
}

TEST(DataParallel, OptimizerShardsTileTheBufferAndKeepMatricesWhole) {
  const fs::path dir = shared_dir("shards");
  Trainer t(config(dir, dir / "out", {}, kMuon), world_context(), true);
  const auto [b, e] = t.backend().optimizer_shard();
  std::vector<std::int64_t> all(static_cast<std::size_t>(2 * world_size()));
  const std::int64_t mine[2] = {b, e};
  MPI_Allgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T, MPI_COMM_WORLD);
  const auto& layout = t.backend().layout();
  EXPECT_EQ(all.front(), 0);
  EXPECT_EQ(all.back(), layout.total_floats);
  for (int r = 0; r + 1 < world_size(); ++r) EXPECT_EQ(all[2 * r + 1], all[2 * r + 2]) << "gap or overlap after rank " << r;
  // Each Muon matrix lies inside one rank's shard.
  std::int64_t muon_floats = 0, owned = 0;
  for (const auto& m : parallel::muon_matrices_in(layout, 0, layout.total_floats)) muon_floats += m.rows * m.cols;
  for (const auto& m : parallel::muon_matrices_in(layout, b, e)) owned += m.rows * m.cols;
  MPI_Allreduce(MPI_IN_PLACE, &owned, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_GT(muon_floats, 0);
  EXPECT_EQ(owned, muon_floats);
  const TrainState st = t.backend().state();
  EXPECT_EQ(st.adam_m.size(), static_cast<std::size_t>(e - b)) << "optimizer state only for the shard";
}

// Trains to step 4 and saves in `from` (1 rank or all), resumes in `to` and finishes; the
// losses of steps 5..8 match the uninterrupted run at `to`'s world size.
void expect_resume(bool save_on_world, bool resume_on_world, const std::string& tag) {
  const fs::path dir = shared_dir(tag);
  const auto ctx = [&](bool on_world) { return on_world ? world_context() : parallel::Mesh(); };
  const auto out = [&](const std::string& name, bool on_world) {
    return on_world ? dir / name : dir / (name + std::to_string(world_rank()));
  };
  TrainConfig full_cfg = config(dir, out("full", resume_on_world), {"checkpoint.final=false"}, kMuon);
  Trainer full(full_cfg, ctx(resume_on_world), true);
  const auto expect = full.run();

  TrainConfig first_cfg = config(dir, out("first", save_on_world), {"checkpoint.interval=4"}, kMuon);
  {
    Trainer first(first_cfg, ctx(save_on_world), true);
    first.run(4);
    first.finish_checkpoint();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  TrainConfig second_cfg = config(dir, out("second", resume_on_world), {"checkpoint.final=false"}, kMuon);
  Trainer second(second_cfg, ctx(resume_on_world), true);
  second.resume(first_cfg.checkpoint_dir);
  ASSERT_EQ(second.step(), 4);
  const auto got = second.run();
  ASSERT_EQ(got.size(), 4u);
  const bool same_world = save_on_world == resume_on_world || world_size() == 1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (same_world)
      EXPECT_EQ(got[i].loss, expect[i + 4].loss) << tag << ": resume in the same layout is bit-exact, step " << i + 5;
    else
      EXPECT_NEAR(got[i].loss, expect[i + 4].loss, 1e-5 * std::fabs(expect[i + 4].loss)) << tag << " step " << i + 5;
  }
  EXPECT_LE(max_rel_diff(second.backend().state().params, full.backend().state().params), same_world ? 0.0 : 2e-5) << tag;
}

TEST(DataParallel, ResumesAtTheSameWorldSizeBitExact) { expect_resume(true, true, "resume_nn"); }
TEST(DataParallel, CheckpointOfNRanksResumesOnOne) { expect_resume(true, false, "resume_n1"); }
TEST(DataParallel, CheckpointOfOneRankResumesOnN) { expect_resume(false, true, "resume_1n"); }

TEST(DataParallel, BatchThatDoesNotSplitIsRefusedOnEveryRank) {
  const fs::path dir = shared_dir("split");
  if (12 % world_size() == 0 && 5 % world_size() != 0) {
    TrainConfig cfg = config(dir, dir / "out", {"batch.grad_accum=5"});
    try {
      Trainer t(cfg, world_context(), true);
      FAIL() << "grad_accum 5 accepted on " << world_size() << " ranks";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("must be a multiple of the data-parallel degree"), std::string::npos) << e.what();
    }
  }
}

// The CUDA backend under data parallelism (NCCL, one GPU per rank; skipped without a GPU per
// rank) against one GPU on the same global batch. GPU runs agree only to rounding (bf16
// activations, atomics), and on this small fast-learning model rounding differences grow
// through the top-k routing within a few steps; so the comparison is of the first step, where
// only the summation order of the gradients differs: the same loss, the same gradient norm and
// the same update (relative to the update's size). Then 8 steps must learn on both, and every
// rank must hold the same parameters.
TEST(DataParallel, GpusMatchOneGpu) {
  if (!keel::test::gpu_per_rank()) GTEST_SKIP() << "needs a GPU per rank (" << visible_cuda_devices() << " visible)";
  keel::test::use_rank_gpu();
  const fs::path dir = shared_dir("gpu");
  const std::vector<std::string> gpu = {"device=cuda", "model.hidden=128", "model.head_dim=64", "model.ffn_hidden=256",
                                        "model.expert_hidden=128", "checkpoint.final=false"};
  for (const std::string& opt : {std::string(), kMuon}) {
    const std::string tag = opt.empty() ? "adamw" : "muon";
    TrainConfig cfg = config(dir, dir / ("dp_" + tag), gpu, opt);
    Trainer dp(cfg, world_context(), true);
    TrainConfig one = cfg;
    one.output_dir = one.checkpoint_dir = (dir / ("single_" + tag + std::to_string(world_rank()))).string();
    Trainer single(one, parallel::Mesh(), true);
    const std::vector<float> p0 = single.backend().state().params;
    ASSERT_EQ(dp.backend().state().params, p0) << "the same initialization";
    const StepStats a = dp.run(1).at(0), b = single.run(1).at(0);
    EXPECT_NEAR(a.loss, b.loss, 1e-4 * std::fabs(b.loss)) << tag;
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-3 * b.grad_norm) << tag;
    EXPECT_LT(fixtures::norm_rel_diff(dp.backend().state().params, single.backend().state().params, p0), 2e-2) << tag;
    const auto dp_rest = dp.run(), single_rest = single.run();
    ASSERT_EQ(dp_rest.size(), 7u);
    EXPECT_LT(dp_rest.back().loss, 0.5 * a.loss) << tag << ": learns";
    EXPECT_LT(single_rest.back().loss, 0.5 * b.loss) << tag << ": learns";
    if (world_rank() == 0)
      std::printf("  %s: step 8 loss %.4f on %d GPUs, %.4f on one\n", tag.c_str(), dp_rest.back().loss, world_size(),
                  single_rest.back().loss);
    const auto p = dp.backend().state().params;
    double sum = 0;
    for (float x : p) sum += x;
    double root = sum;
    MPI_Bcast(&root, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    EXPECT_EQ(sum, root) << "parameters differ between ranks";
  }
}

}  // namespace
}  // namespace keel::train

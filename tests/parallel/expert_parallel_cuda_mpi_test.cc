// Expert parallelism on GPUs (parallel/expert_parallel_cuda.h; one GPU per rank, skipped
// without one per rank or without CUDA):
//  - the op: each rank's tokens through CudaExpertParallelMoe equal the one-GPU moe::forward /
//    backward over all E experts on the same tokens (uneven token counts, a rank without
//    tokens, experts and whole ranks receiving nothing); expert weight gradients equal the sum
//    over ranks of the one-GPU gradients of the same experts;
//  - keel train with parallel.expert = world on GPUs trains like pure data parallelism on the
//    same ranks and batches (linear router with Muon; the ZAYA1 MLP router with the skip class),
//    and a checkpoint saved at EP = world resumes under pure data parallelism.
// GPU results are bf16 GEMMs whose row blocks differ in height between the two paths, so the
// comparisons are at bf16 tolerance, not bit for bit.
#if defined(KEEL_HAVE_CUDA)

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../mpi_test_util.h"
#include "../ops/cuda/cuda_test_util.h"
#include "../train/train_mpi_test_util.h"
#include "../train/train_test_util.h"
#include "ops/cuda/moe.h"
#include "parallel/expert_parallel_cuda.h"
#include "train/model.h"
#include "train/trainer.h"

namespace keel::parallel {
namespace {

namespace fs = std::filesystem;
namespace moe = ops::cuda::moe;
using keel::test::DeviceArray;
using keel::test::world_rank;
using keel::test::world_size;
using bf16 = __nv_bfloat16;

bool have_gpu_per_rank() { return world_size() >= 2 && visible_cuda_devices() >= world_size(); }

// One rank's side of the op test. tokens: this rank's N; experts_used: routing picks among
// experts [0, experts_used) only (so later experts, and ranks, may receive nothing).
void expect_op_matches_one_gpu(std::int64_t tokens, int experts_used, const std::string& tag) {
  const int P = world_size(), rank = world_rank();
  const int E = 4 * P, El = E / P, K = 2;
  const std::int64_t D = 64, F = 96, N = tokens, S = N * K;
  cudaStream_t stream = nullptr;
  KEEL_CUDA_CHECK(cudaStreamCreate(&stream));
  // the whole layer's weights, the same on every rank
  const auto wg = test::to_device<bf16>(test::random_vector(E * F * D, 11, -0.2f, 0.2f));
  const auto wu = test::to_device<bf16>(test::random_vector(E * F * D, 12, -0.2f, 0.2f));
  const auto wd = test::to_device<bf16>(test::random_vector(E * D * F, 13, -0.2f, 0.2f));
  // this rank's tokens, gates, routing (K distinct experts per token) and output gradient
  const std::uint64_t seed = 100 + 7 * rank;
  const auto x = test::to_device<bf16>(test::random_vector(N * D, seed));
  const auto gates = test::to_device<float>(test::random_vector(S, seed + 1, 0.1f, 1.f));
  const auto dy = test::to_device<float>(test::random_vector(N * D, seed + 2));
  std::vector<std::int32_t> idx_h(static_cast<std::size_t>(S));
  std::mt19937 rng(static_cast<unsigned>(seed + 3));
  for (std::int64_t n = 0; n < N; ++n) {
    const int a = static_cast<int>(rng() % experts_used);
    const int b = (a + 1 + static_cast<int>(rng() % (experts_used - 1))) % experts_used;
    idx_h[n * K] = a, idx_h[n * K + 1] = b;
  }
  const auto idx = test::ints_to_device(idx_h);
  DeviceArray<std::int32_t> ws(static_cast<std::size_t>(moe::plan_ints(S, E)));
  const moe::Plan plan = moe::make_plan(S ? idx.get() : nullptr, N, K, E, ws.get(), stream);

  // one GPU, all experts
  const std::size_t s1 = std::max<std::int64_t>(S, 1);
  DeviceArray<bf16> xs(s1 * D), hg(s1 * F), hu(s1 * F), act(s1 * F), ys(s1 * D);
  DeviceArray<float> y_ref(std::max<std::int64_t>(N, 1) * D), dgates_ref(s1);
  DeviceArray<bf16> dx_ref(std::max<std::int64_t>(N, 1) * D);
  DeviceArray<float> gg_ref(E * F * D), gu_ref(E * F * D), gd_ref(E * D * F);
  DeviceArray<std::byte> scratch(static_cast<std::size_t>(moe::backward_scratch_bytes(s1, D, F)));
  const moe::Weights w{wg.get(), wu.get(), wd.get()};
  const moe::Saved saved{xs.get(), hg.get(), hu.get(), act.get(), ys.get()};
  moe::forward(plan, x.get(), gates.get(), w, D, F, saved, y_ref.get(), stream);
  moe::backward(plan, gates.get(), w, D, F, saved, dy.get(), scratch.get(), dx_ref.get(), dgates_ref.get(),
                {gg_ref.get(), gu_ref.get(), gd_ref.get()}, stream);

  // expert parallel: this rank's El experts are a slab of the whole weights
  auto group = std::make_shared<CudaExpertParallelGroup>(MPI_COMM_WORLD, make_nccl_group(MPI_COMM_WORLD), E);
  CudaExpertParallelMoe layer(group);
  const moe::Weights local{wg.get() + rank * El * F * D, wu.get() + rank * El * F * D, wd.get() + rank * El * D * F};
  DeviceArray<bf16> xs2(s1 * D), ys2(s1 * D), dx(std::max<std::int64_t>(N, 1) * D);
  DeviceArray<float> y(std::max<std::int64_t>(N, 1) * D), dgates(s1);
  DeviceArray<float> gg(El * F * D), gu(El * F * D), gd(El * D * F);
  const moe::Saved slots{xs2.get(), nullptr, nullptr, nullptr, ys2.get()};
  layer.forward(plan, x.get(), gates.get(), local, D, F, slots, y.get(), stream);
  layer.backward(plan, gates.get(), local, D, F, slots, dy.get(), nullptr, dx.get(), dgates.get(),
                 {gg.get(), gu.get(), gd.get()}, stream);
  KEEL_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::int64_t rows[2] = {layer.received_rows(), S};
  MPI_Allreduce(MPI_IN_PLACE, rows, 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(rows[0], rows[1]) << tag << ": every routed slot computed once, at its expert's rank";
  if (N > 0) {
    auto head = [&](std::vector<float> v, std::int64_t n) { v.resize(static_cast<std::size_t>(n)); return v; };
    EXPECT_TRUE(test::all_close(head(test::to_host(y), N * D), head(test::to_host(y_ref), N * D), 1e-2f, 1e-3f, tag + " y"));
    EXPECT_TRUE(test::all_close(head(test::to_host(dx), N * D), head(test::to_host(dx_ref), N * D), 1e-2f, 1e-3f, tag + " dx"));
    EXPECT_TRUE(test::all_close(head(test::to_host(dgates), S), head(test::to_host(dgates_ref), S), 1e-2f, 1e-3f,
                                tag + " dgates"));
  }
  // expert gradients: the group's sum of the one-GPU gradients, this rank's slab
  for (auto [got, want, per] : {std::tuple{&gg, &gg_ref, F * D}, std::tuple{&gu, &gu_ref, F * D},
                                std::tuple{&gd, &gd_ref, D * F}}) {
    std::vector<float> sum = test::to_host(*want);
    MPI_Allreduce(MPI_IN_PLACE, sum.data(), static_cast<int>(sum.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    std::vector<float> slab(sum.begin() + rank * El * per, sum.begin() + (rank + 1) * El * per);
    EXPECT_LT(test::norm_rel_err(test::to_host(*got), slab), 2e-3) << tag << ": expert weight gradients";
  }
  KEEL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(ExpertParallelCuda, OpMatchesOneGpu) {
  if (!have_gpu_per_rank()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank";
  set_cuda_device(world_rank());
  expect_op_matches_one_gpu(48 + 29 * world_rank(), 4 * world_size(), "uneven");
}

TEST(ExpertParallelCuda, OpHandlesEmptyRanksAndExperts) {
  if (!have_gpu_per_rank()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank";
  set_cuda_device(world_rank());
  // rank 0 has no tokens; the rest route to the first 3 experts only (rank 0's): every other
  // rank's experts receive nothing
  expect_op_matches_one_gpu(world_rank() == 0 ? 0 : 40, 3, "empty");
}

}  // namespace
}  // namespace keel::parallel

namespace keel::train {
namespace {

namespace fs = std::filesystem;
using keel::test::world_rank;
using keel::test::world_size;

// Every rank on its own GPU (false: skip).
bool have_gpu_per_rank_train() {
  if (world_size() < 2 || visible_cuda_devices() < world_size()) return false;
  set_cuda_device(world_rank());
  return true;
}

using fixtures::world_context;

TrainConfig gpu_config(const fs::path& dir, const fs::path& out, int ep, const std::vector<std::string>& extra,
                       const std::string& optimizer_extra) {
  if (world_rank() == 0 && !fs::exists(dir / "d.idx")) fixtures::make_dataset(dir, "d");
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> sets = {"batch.micro_batch=1",  "batch.grad_accum=24",     "steps=6",
                                   "device=cuda",          "model.hidden=128",        "model.head_dim=64",
                                   "model.ffn_hidden=256", "model.expert_hidden=128", "model.experts=8",
                                   "parallel.expert=" + std::to_string(ep)};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return parse_train_config(fixtures::train_config_text((dir / "d").string(), out, optimizer_extra), "ep.yaml", sets);
}

const std::string& kMuon = fixtures::kMuonOptimizer;
const std::vector<std::string>& kZayaRouter = fixtures::kZayaRouterSets;

void expect_ep_matches_data_parallel(const std::vector<std::string>& extra, const std::string& opt,
                                     const std::string& tag) {
  const int P = world_size();
  if (8 % P != 0) GTEST_SKIP() << "8 experts do not split over " << P << " ranks";
  const fs::path dir = keel::test::shared_temp_dir("ep_cuda", tag);
  std::vector<std::string> sets = extra;
  sets.push_back("checkpoint.final=false");
  Trainer dp(gpu_config(dir, dir / "dp", 1, sets, opt), world_context(1), true);
  const auto want = dp.run(4);
  Trainer ep(gpu_config(dir, dir / "ep", P, sets, opt), world_context(P), true);
  const StateSlice sl = ep.backend().state_slice();
  EXPECT_EQ(sl.expert_parallel, P);
  EXPECT_EQ(ep.backend().param_count(), dp.backend().param_count()) << "the whole model's count on every rank";
  const auto got = ep.run(4);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_NEAR(got[0].loss, want[0].loss, 1e-4 * std::fabs(want[0].loss)) << tag << ": the same initialization";
  EXPECT_NEAR(got[0].grad_norm, want[0].grad_norm, 1e-2 * want[0].grad_norm) << tag;
  for (std::size_t i = 1; i < got.size(); ++i)
    EXPECT_NEAR(got[i].loss, want[i].loss, 1e-2 * std::fabs(want[i].loss)) << tag << " step " << i + 1;
  if (world_rank() == 0)
    std::printf("  %s: EP %d on %d GPUs vs data parallel: loss %.6f vs %.6f after 4 steps\n", tag.c_str(), P, P,
                got.back().loss, want.back().loss);
}

TEST(ExpertParallelCuda, TrainEpWorldMatchesDataParallelWithMuon) {
  if (!have_gpu_per_rank_train()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank";
  expect_ep_matches_data_parallel({}, kMuon, "muon");
}

// EP = world / 2 on 4 or 8 GPUs: every expert on 2 or 4 GPUs, whose expert gradients are
// reduced to the shard owners over the expert-data group and whose updated shards are broadcast
// back (the expert-data collectives EP = world never runs).
TEST(ExpertParallelCuda, TrainEpHalfWithReplicasMatchesDataParallel) {
  if (!have_gpu_per_rank_train() || world_size() < 4) GTEST_SKIP() << "needs 4+ ranks and a GPU per rank";
  const int P = world_size(), ep = P / 2;
  if (8 % ep != 0 || 24 % P != 0) GTEST_SKIP() << "EP " << ep << " or " << P << " ranks do not split the model and batch";
  const fs::path dir = keel::test::shared_temp_dir("ep_cuda", "replicas");
  const std::vector<std::string> sets = {"checkpoint.final=false"};
  Trainer dp(gpu_config(dir, dir / "dp", 1, sets, kMuon), world_context(1), true);
  const auto want = dp.run(4);
  // Each rank keeps the fp32 masters of its own expert shard only (the bf16 copy travels), and,
  // with parallel.zero1.shard_masters: false, every master (state() then gathers the stale ones).
  for (const bool shard_masters : {true, false}) {
    std::vector<std::string> ep_sets = sets;
    if (!shard_masters) ep_sets.push_back("parallel.zero1.shard_masters=false");
    const std::string tag = shard_masters ? "replicas" : "replicas_every_master";
    Trainer ep_run(gpu_config(dir, dir / (shard_masters ? "ep" : "ep_all"), ep, ep_sets, kMuon), world_context(ep), true);
    const StateSlice sl = ep_run.backend().state_slice();
    std::int64_t covered = sl.expert_end - sl.expert_begin;
    MPI_Allreduce(MPI_IN_PLACE, &covered, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    std::int64_t region = 0;
    for (const auto& p : ep_run.backend().layout().params)
      if (p.placement.splits(mesh::Axis::kExpert)) region += p.numel;
    EXPECT_EQ(covered, ep * region) << "the expert-data shards tile each expert group's region once";
    const auto got = ep_run.run(4);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_NEAR(got[0].loss, want[0].loss, 1e-4 * std::fabs(want[0].loss));
    EXPECT_NEAR(got[0].grad_norm, want[0].grad_norm, 1e-2 * want[0].grad_norm);
    for (std::size_t i = 1; i < got.size(); ++i)
      EXPECT_NEAR(got[i].loss, want[i].loss, 1e-2 * std::fabs(want[i].loss)) << "step " << i + 1;
    // every replica of an expert holds the same weights after the broadcasts
    const auto params = ep_run.backend().state().params;
    double sum = 0;
    for (float x : params) sum += x;
    std::vector<double> sums(static_cast<std::size_t>(P));
    MPI_Allgather(&sum, 1, MPI_DOUBLE, sums.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
    for (int r = 0; r < P; ++r) EXPECT_EQ(sums[static_cast<std::size_t>(r)], sums[static_cast<std::size_t>(r % ep)]) << "rank " << r;
    if (world_rank() == 0)
      std::printf("  %s: EP %d on %d GPUs vs data parallel: loss %.6f vs %.6f after 4 steps\n", tag.c_str(), ep, P,
                  got.back().loss, want.back().loss);
  }
}

TEST(ExpertParallelCuda, TrainEpWorldMatchesDataParallelWithTheZayaRouter) {
  if (!have_gpu_per_rank_train()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank";
  expect_ep_matches_data_parallel(kZayaRouter, "", "zaya");
}

// Saved at EP = world after 3 steps, resumed under pure data parallelism: steps 4..6 as the
// uninterrupted data-parallel run (GPU tolerance).
TEST(ExpertParallelCuda, CheckpointAtEpWorldResumesUnderDataParallelism) {
  if (!have_gpu_per_rank_train()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank";
  const int P = world_size();
  if (8 % P != 0) GTEST_SKIP() << "8 experts do not split over " << P << " ranks";
  const fs::path dir = keel::test::shared_temp_dir("ep_cuda", "resume");
  Trainer full(gpu_config(dir, dir / "full", 1, {"checkpoint.final=false"}, kMuon), world_context(1), true);
  const auto expect = full.run();
  TrainConfig first_cfg = gpu_config(dir, dir / "first", P, {"checkpoint.interval=3"}, kMuon);
  {
    Trainer first(first_cfg, world_context(P), true);
    first.run(3);
    first.finish_checkpoint();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Trainer second(gpu_config(dir, dir / "second", 1, {"checkpoint.final=false"}, kMuon), world_context(1), true);
  second.resume(first_cfg.checkpoint_dir);
  ASSERT_EQ(second.step(), 3);
  const auto got = second.run();
  ASSERT_EQ(got.size(), 3u);
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i].loss, expect[i + 3].loss, 1e-2 * std::fabs(expect[i + 3].loss)) << "step " << i + 4;
}

}  // namespace
}  // namespace keel::train

#endif  // KEEL_HAVE_CUDA

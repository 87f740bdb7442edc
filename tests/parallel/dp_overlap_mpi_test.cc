// The overlapped ZeRO-1 step on GPUs (NCCL, one GPU per rank; skipped without a GPU per rank):
// bucketed reduces during backward, per-bucket broadcasts after the update, deferred embedding
// scatter, bf16 or fp32 broadcasts, the optimizer on its own stream or on the compute stream
// (src/train/cuda_backend_cuda.cc, docs/parallel.md) train
// like the classic step (parallel.zero1.overlap: false: reduce-scatter after backward, all-gather after
// the update) on the same ranks and batches.
//
// Not bit for bit: the embedding backward adds repeated tokens with atomics (on one GPU too),
// the deferred scatter adds the last micro-batch's rows after the reduce instead of before,
// and Muon batches a stack's matrices per bucket rather than per shard. So: the first step's
// loss and gradient norm to fp32 rounding, its update to 1e-3 of its size; after 4 steps
// (where routing can amplify rounding on this small model) the losses to 1e-2 and the
// parameters to 5e-2 of the distance travelled. Every rank holds the same parameters.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "../mpi_test_util.h"
#include "../train/train_mpi_test_util.h"
#include "../train/train_test_util.h"
#include "device/cuda_devices.h"
#include "train/trainer.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;
using keel::test::world_rank;
using keel::test::world_size;

// `parallel.zero1.*` settings of a variant (config overrides, every rank alike).
using Env = std::vector<std::string>;

fs::path shared_dir(const std::string& name) { return keel::test::shared_temp_dir("dp_overlap", name); }

TrainConfig gpu_config(const fs::path& dir, const fs::path& out, const std::string& optimizer_extra,
                       const std::vector<std::string>& more = {}) {
  if (world_rank() == 0 && !fs::exists(dir / "d.idx")) fixtures::make_dataset(dir, "d");
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> sets = {"batch.micro_batch=1",   "batch.grad_accum=12",     "steps=8",
                                   "device=cuda",           "model.hidden=128",        "model.head_dim=64",
                                   "model.ffn_hidden=256",  "model.expert_hidden=128", "checkpoint.final=false"};
  sets.insert(sets.end(), more.begin(), more.end());  // later settings win
  return parse_train_config(fixtures::train_config_text((dir / "d").string(), out, optimizer_extra), "dp.yaml", sets);
}

struct TrainRun {
  std::vector<StepStats> stats;  // steps 1..4
  std::vector<float> p0, p1, p4;  // parameters before, after step 1, after step 4
  std::size_t memory_bytes = 0;   // the backend's device memory, before step 1
  std::size_t memory_after = 0;   // and after step 4
};

TrainRun train(const fs::path& dir, const std::string& tag, const std::string& optimizer_extra, const Env& env,
               const std::vector<std::string>& more = {}, int ep = 1) {
  std::vector<std::string> sets = more;
  sets.insert(sets.end(), env.begin(), env.end());
  sets.push_back("parallel.expert=" + std::to_string(ep));
  Trainer t(gpu_config(dir, dir / tag, optimizer_extra, sets), fixtures::world_context(ep), true);
  TrainRun r;
  r.memory_bytes = t.backend().memory_bytes();
  r.p0 = t.backend().state().params;
  r.stats = t.run(1);
  r.p1 = t.backend().state().params;  // gathers the fp32 masters after bf16 broadcasts
  const auto rest = t.run(4);
  r.stats.insert(r.stats.end(), rest.begin(), rest.end());
  r.p4 = t.backend().state().params;
  r.memory_after = t.backend().memory_bytes();
  double sum = 0;
  for (float x : r.p4) sum += x;
  // with expert parallelism a rank holds its expert group's experts: ranks r and r % ep alike
  std::vector<double> sums(static_cast<std::size_t>(world_size()));
  MPI_Allgather(&sum, 1, MPI_DOUBLE, sums.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
  EXPECT_EQ(sum, sums[static_cast<std::size_t>(world_rank() % ep)]) << tag << ": parameters differ between ranks";
  return r;
}

// Two runs of one model and data that must train alike: the first step's loss, gradient norm
// (within norm_tol) and update, the next 3 steps' losses, and the parameters after 4 steps
// (drift: below). Returns the first update's and the 4-step difference, over their sizes.
std::pair<double, double> expect_trains_alike(const TrainRun& got, const TrainRun& want, double norm_tol,
                                              const std::string& tag) {
  EXPECT_TRUE(got.p0 == want.p0) << tag << ": the same initialization";
  const StepStats &a = got.stats[0], &b = want.stats[0];
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(b.loss)) << tag;
  EXPECT_NEAR(a.grad_norm, b.grad_norm, norm_tol * b.grad_norm) << tag;
  const double d1 = fixtures::norm_rel_diff(got.p1, want.p1, want.p0);
  EXPECT_LT(d1, 1e-3) << tag << ": first update";
  for (std::size_t i = 1; i < 4; ++i)
    EXPECT_NEAR(got.stats[i].loss, want.stats[i].loss, 1e-2 * std::fabs(want.stats[i].loss)) << tag << " step " << i + 1;
  const double d4 = fixtures::norm_rel_diff(got.p4, want.p4, want.p0);
  // Later steps drift apart where the deferred embedding scatter runs: it adds the rows'
  // gradients in another order than the classic step, so embedding masters differ in their
  // last bits and some round to other bf16 values for the lookup (which reads the bf16
  // copy); the rest of the model carries that on, and Muon's normalized updates in full. On
  // 4 H200s: 2.7e-3 (AdamW) and 6.3e-2 (Muon) with the scatter deferred, 5e-9 without; a
  // wrong update is O(1).
  EXPECT_LT(d4, 1.5e-1) << tag << ": after 4 steps";
  return {d1, d4};
}

TEST(DataParallel, GpuOverlappedStepMatchesClassicStep) {
  // NCCL's own reductions: its summation order is what the tolerances below were set on (ranks
  // sharing a GPU through KEEL_NCCL_OVER_MPI sum in MPI's order, which Muon's Newton-Schulz
  // amplifies past them at 4 ranks)
  const int gpus = visible_cuda_devices();
  if (world_size() < 2 || gpus < world_size()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank (" << gpus << " visible)";
  set_cuda_device(world_rank());
  const fs::path dir = shared_dir("gpu");
  const std::vector<std::pair<std::string, Env>> variants = {
      {"overlap", {}},
      // many small buckets (Muon matrices alone, AdamW tensors cut), the deferred scatter forced
      {"small_buckets_deferred", {"parallel.zero1.bucket_mib=0.004", "parallel.zero1.defer_embedding=true"}},
      // fp32 broadcasts, the embedding reduced after backward
      {"fp32_broadcast", {"parallel.zero1.bucket_mib=0.05", "parallel.zero1.defer_embedding=false", "parallel.zero1.broadcast_bf16=false"}},
      // the optimizer on the compute stream, one NCCL launch per bucket
      {"no_opt_stream", {"parallel.zero1.bucket_mib=0.02", "parallel.zero1.optimizer_stream=false", "parallel.zero1.group_reduces=false"}},
  };
  for (const std::string& opt : {std::string(), fixtures::kMuonOptimizer}) {
    const std::string o = opt.empty() ? "adamw" : "muon";
    const TrainRun classic = train(dir, "classic_" + o, opt, {"parallel.zero1.overlap=false"});
    ASSERT_EQ(classic.stats.size(), 4u);
    for (const auto& [name, env] : variants) {
      const std::string tag = name + "_" + o;
      const TrainRun got = train(dir, tag, opt, env);
      ASSERT_EQ(got.stats.size(), 4u) << tag;
      const auto [d1, d4] = expect_trains_alike(got, classic, 1e-5, tag);
      if (world_rank() == 0)
        std::printf("  %s on %d GPUs: step 1 update differs by %.2e of its size, after 4 steps %.2e; loss %.6f vs %.6f "
                    "(classic)\n",
                    tag.c_str(), world_size(), d1, d4, got.stats.back().loss, classic.stats.back().loss);
    }
  }
}

// Expert parallelism in the classic step (parallel.zero1.overlap: false): the replicated region
// reduce-scattered over the data group, the expert region over the expert-data group (4+ ranks
// with ep = half the ranks; at 2 ranks ep = 2 and each rank's experts need no exchange), each
// region's padded NCCL chunks keeping the floats past its end. Against the overlapped step with
// the same expert parallelism: the first step's loss, norm and update as above, then 4 steps.
TEST(DataParallel, GpuClassicStepWithExpertParallelMatchesOverlapped) {
  if (!keel::test::gpu_per_rank()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank";
  keel::test::use_rank_gpu();
  const int ep = world_size() >= 4 && world_size() % 2 == 0 ? world_size() / 2 : world_size();
  if (4 % ep != 0) GTEST_SKIP() << "ep " << ep << " does not divide the tiny MoE's 4 experts";
  const fs::path dir = shared_dir("gpu_ep_classic");
  for (const std::string& opt : {std::string(), fixtures::kMuonOptimizer}) {
    const std::string o = opt.empty() ? "adamw" : "muon";
    const TrainRun classic = train(dir, "classic_ep_" + o, opt, {"parallel.zero1.overlap=false"}, {}, ep);
    const TrainRun overlap = train(dir, "overlap_ep_" + o, opt, {}, {}, ep);
    ASSERT_EQ(classic.stats.size(), 4u);
    ASSERT_EQ(overlap.stats.size(), 4u);
    const auto [d1, d4] = expect_trains_alike(classic, overlap, 1e-4, o);
    if (world_rank() == 0)
      std::printf("  classic step with ep %d, %s, %d GPUs: step 1 update differs by %.2e of its size, after 4 steps "
                  "%.2e; loss %.6f vs %.6f (overlapped)\n",
                  ep, o.c_str(), world_size(), d1, d4, classic.stats.back().loss, overlap.stats.back().loss);
  }
}

// parallel.grad_reduce: bf16 on GPUs. The overlapped step rounds each stage's gradients into a
// bf16 scratch, reduces them there (ncclReduce per bucket) and widens the owner's part back; the
// classic step reduce-scatters a bf16 copy of the whole buffer. At 2 ranks both add two bf16
// values once, so the sums are the same and the first step agrees as in the fp32 comparison
// above. Elsewhere to bf16 precision: at more ranks NCCL's chains round partial sums
// differently; the deferred embedding scatter adds the last micro-batch's rows in fp32 after
// the bf16 reduce; and with expert parallelism over half the ranks (4+ ranks; the expert
// region's reduce over the expert-data group goes through the same scratch) the experts' GEMMs
// run on other row blocks and the flat buffer holds each rank's experts last, so only the
// losses and gradient norms compare (as in the expert-parallel tests). Every variant stays
// within bf16 precision of the fp32 step without being it.
TEST(DataParallel, GpuBf16GradientReduceMatchesClassicStep) {
  // NCCL's own reductions: its summation order is what the tolerances below were set on (ranks
  // sharing a GPU through KEEL_NCCL_OVER_MPI sum in MPI's order, which Muon's Newton-Schulz
  // amplifies past them at 4 ranks)
  const int gpus = visible_cuda_devices();
  if (world_size() < 2 || gpus < world_size()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank (" << gpus << " visible)";
  set_cuda_device(world_rank());
  const fs::path dir = shared_dir("gpu_bf16_reduce");
  const std::vector<std::string> bf16 = {"parallel.grad_reduce=bf16"};
  const bool two = world_size() == 2;
  struct Variant {
    std::string name;
    Env env;
    int ep;
    bool exact;  // the classic step's sums, bit for bit
  };
  std::vector<Variant> variants = {
      {"small_buckets", {"parallel.zero1.bucket_mib=0.004", "parallel.zero1.defer_embedding=false"}, 1, two},
      {"deferred_embedding", {"parallel.zero1.defer_embedding=true"}, 1, false}};
  if (world_size() >= 4 && world_size() % 2 == 0) variants.push_back({"ep2", {}, 2, false});
  for (const std::string& opt : {std::string(), fixtures::kMuonOptimizer}) {
    const std::string o = opt.empty() ? "adamw" : "muon";
    const TrainRun fp32 = train(dir, "fp32_" + o, opt, {});
    const TrainRun classic = train(dir, "classic_bf16_" + o, opt, {"parallel.zero1.overlap=false"}, bf16);
    ASSERT_EQ(classic.stats.size(), 4u) << o;
    EXPECT_NEAR(classic.stats[0].grad_norm, fp32.stats[0].grad_norm, 1e-2 * fp32.stats[0].grad_norm) << o;
    EXPECT_FALSE(classic.p4 == fp32.p4) << o << ": bf16 reduction trained bit for bit as fp32";
    // the classic step's bf16 copy of the buffer (allocated at the first reduction) is counted
    EXPECT_GE(classic.memory_after, classic.memory_bytes + 2 * classic.p0.size()) << o;
    for (const auto& v : variants) {
      const std::string tag = v.name + "_bf16_" + o;
      const TrainRun got = train(dir, tag, opt, v.env, bf16, v.ep);
      ASSERT_EQ(got.stats.size(), 4u) << tag;
      const StepStats &a = got.stats[0], &b = classic.stats[0];
      EXPECT_NEAR(a.loss, b.loss, (v.ep == 1 ? 1e-5 : 1e-3) * std::fabs(b.loss)) << tag;
      EXPECT_NEAR(a.grad_norm, b.grad_norm, (v.exact ? 1e-5 : 1e-2) * b.grad_norm) << tag;
      for (std::size_t i = 1; i < 4; ++i)
        EXPECT_NEAR(got.stats[i].loss, classic.stats[i].loss, 2e-2 * std::fabs(classic.stats[i].loss))
            << tag << " step " << i + 1;
      double d1 = NAN, d4 = NAN;
      if (v.ep == 1) {
        d1 = fixtures::norm_rel_diff(got.p1, classic.p1, classic.p0);
        EXPECT_LT(d1, v.exact ? 1e-3 : 5e-2) << tag << ": first update";
        d4 = fixtures::norm_rel_diff(got.p4, classic.p4, classic.p0);
        EXPECT_LT(d4, 1.5e-1) << tag << ": after 4 steps";
      }
      if (world_rank() == 0)
        std::printf("  %s on %d GPUs: %s; loss %.6f vs %.6f (classic bf16), %.6f (fp32)\n", tag.c_str(), world_size(),
                    v.ep == 1 ? fmt::format("step 1 update differs by {:.2e} of its size, after 4 steps {:.2e}", d1, d4).c_str()
                              : "grad norm and losses only (another flat layout)",
                    got.stats.back().loss, classic.stats.back().loss, fp32.stats.back().loss);
    }
  }
}

// With bf16 broadcasts a rank keeps the fp32 masters of its own shard and of the parameters
// that travel in fp32 only (parallel.zero1.shard_masters, default on); the rest of the flat buffer's
// addresses are not backed. The model here is large enough (about 30M parameters, 120 MB of
// fp32 masters) that the 2 MiB granules of the small fp32 parameters do not hide the saving.
// Training is the same computation either way; state() gathers the masters from their owners.
TEST(DataParallel, GpuShardedMastersKeepLessAndTrainAlike) {
  if (!keel::test::gpu_per_rank()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank (" << visible_cuda_devices() << " visible)";
  keel::test::use_rank_gpu();
  const fs::path dir = shared_dir("gpu_masters");
  const std::vector<std::string> wide = {"model.hidden=512", "model.ffn_hidden=2048", "model.expert_hidden=2048",
                                         "model.experts=8", "steps=4"};
  for (const std::string& opt : {std::string(), fixtures::kMuonOptimizer}) {
    const std::string o = opt.empty() ? "adamw" : "muon";
    const TrainRun all = train(dir, "all_masters_" + o, opt, {"parallel.zero1.shard_masters=false"}, wide);
    const TrainRun sharded = train(dir, "sharded_masters_" + o, opt, {}, wide);
    ASSERT_EQ(sharded.stats.size(), 4u) << o;
    EXPECT_TRUE(sharded.p0 == all.p0) << o << ": state() gathers the same initialization";
    EXPECT_NEAR(sharded.stats[0].loss, all.stats[0].loss, 1e-5 * std::fabs(all.stats[0].loss)) << o;
    EXPECT_LT(fixtures::norm_rel_diff(sharded.p1, all.p1, all.p0), 1e-3) << o << ": first update";
    for (std::size_t i = 1; i < 4; ++i)
      EXPECT_NEAR(sharded.stats[i].loss, all.stats[i].loss, 1e-2 * std::fabs(all.stats[i].loss)) << o << " step " << i + 1;
    // All masters: 4 B per parameter on every rank; sharded: about 4 B / ranks, plus granules.
    const double masters = 4.0 * static_cast<double>(all.p0.size());
    const double saved = static_cast<double>(all.memory_bytes) - static_cast<double>(sharded.memory_bytes);
    EXPECT_GT(saved, 0.5 * masters * (1.0 - 1.0 / world_size()))
        << o << ": " << all.memory_bytes << " bytes with every master, " << sharded.memory_bytes << " sharded";
    if (world_rank() == 0)
      std::printf("  %s on %d GPUs: %.1f MiB of fp32 masters, sharding them saved %.1f MiB per GPU; loss %.6f vs %.6f\n",
                  o.c_str(), world_size(), masters / 1048576.0, saved / 1048576.0, sharded.stats.back().loss,
                  all.stats.back().loss);
  }
}

}  // namespace
}  // namespace keel::train

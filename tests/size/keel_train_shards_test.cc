// keel size on the layouts keel train runs: its own ZeRO-1 shards, checked against what they
// must add up to (every Muon matrix stepped once, every parameter's state held once) and
// against the model's own counts.
#include "optim/muon_workspace.h"
#include "size/keel_train_shards.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "model/params.h"
#include "train/model.h"

namespace keel::size {
namespace {

Setup setup(const std::string& model_name, const std::string& layout, int gpus, Optimizer optimizer) {
  Setup s;
  s.model = model::load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/" + model_name + ".yaml");
  s.hardware = hw::load_hardware("h200");
  s.layout = parse_layout(layout, gpus);
  check_layout(s.layout, s.model);
  s.seq = 4096;
  s.optimizer = optimizer;
  return s;
}

double sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

TEST(KeelTrainShards, EveryMuonMatrixIsSteppedOnceWhateverTheLayout) {
  const auto whole = keel_train_shards(setup("zaya1-8b", "zero=1", 1, Optimizer::kMuon));
  ASSERT_TRUE(whole);
  ASSERT_EQ(whole->rank_muon_flops.size(), 1u);
  EXPECT_EQ(whole->rank_muon_flops[0], whole->muon_flops_total);
  for (const auto& [layout, gpus] : std::vector<std::pair<std::string, int>>{
           {"zero=1", 8}, {"zero=1", 1024}, {"ep=8,zero=1", 64}, {"ep=16,zero=1", 16}, {"cp=2,zero=1", 8},
           {"cp=4,ep=8,zero=1", 16}}) {
    SCOPED_TRACE(layout + " on " + std::to_string(gpus));
    const auto k = keel_train_shards(setup("zaya1-8b", layout, gpus, Optimizer::kMuon));
    ASSERT_TRUE(k);
    ASSERT_EQ(k->rank_muon_flops.size(), static_cast<std::size_t>(gpus));
    // The model's matrices are the same under expert parallelism (E / ep experts per rank, ep
    // groups of them), and the ranks' shares add up to them.
    EXPECT_NEAR(k->muon_flops_total, whole->muon_flops_total, 1e-12 * whole->muon_flops_total);
    EXPECT_NEAR(sum(k->rank_muon_flops), k->muon_flops_total, 1e-12 * k->muon_flops_total);
    const int busiest = k->busiest_muon_rank();
    EXPECT_EQ(k->rank_muon_seconds[busiest],
              *std::max_element(k->rank_muon_seconds.begin(), k->rank_muon_seconds.end()));
    EXPECT_GE(k->rank_muon_flops[busiest], 0.95 * k->muon_flops_total / gpus);
    // The step estimate is that rank's.
    const OptimizerStepEstimate o = estimate_muon_step(setup("zaya1-8b", layout, gpus, Optimizer::kMuon));
    EXPECT_EQ(o.seconds, k->rank_muon_seconds[busiest]);
    EXPECT_EQ(o.flops_per_gpu, k->rank_muon_flops[busiest]);
  }
}

TEST(KeelTrainShards, OptimizerStateIsHeldOnceAndTheBusiestRankIsReported) {
  for (const Optimizer opt : {Optimizer::kAdamW, Optimizer::kMuon})
    for (const auto& [layout, gpus] : std::vector<std::pair<std::string, int>>{
             {"zero=1", 1}, {"zero=1", 8}, {"ep=4,zero=1", 8}, {"ep=8,zero=1", 8}, {"cp=2,zero=1", 8},
             {"cp=2,ep=4,zero=1", 8}}) {
      SCOPED_TRACE(layout + " on " + std::to_string(gpus) + (opt == Optimizer::kMuon ? ", Muon" : ", AdamW"));
      const keel::size::Setup s = setup("zaya1-8b", layout, gpus, opt);
      const auto k = keel_train_shards(s);
      ASSERT_TRUE(k);
      ASSERT_EQ(k->rank_optimizer_floats.size(), static_cast<std::size_t>(gpus));
      // Every parameter once over the ranks, plus the layout's alignment padding.
      const double params = static_cast<double>(model::count_params(s.model).total);
      EXPECT_GE(sum(k->rank_optimizer_floats), params);
      EXPECT_LE(sum(k->rank_optimizer_floats), params * (1 + 1e-5));
      EXPECT_GE(k->busiest_optimizer_floats(), k->mean_optimizer_floats());
      // v only for AdamW's floats: all of them under AdamW, the embedding and vectors under Muon.
      ASSERT_EQ(k->rank_adamw_floats.size(), static_cast<std::size_t>(gpus));
      if (opt == Optimizer::kAdamW) EXPECT_EQ(sum(k->rank_adamw_floats), sum(k->rank_optimizer_floats));
      else EXPECT_LT(sum(k->rank_adamw_floats), 0.1 * params);
      for (int r = 0; r < gpus; ++r) EXPECT_LE(k->rank_adamw_floats[r], k->rank_optimizer_floats[r]);
      // The memory estimate holds the busiest rank's 8 B (master, m) per float plus 4 B (v) per
      // AdamW float.
      const MemoryEstimate e = estimate_memory(s);
      EXPECT_EQ(e.keel_train_optimizer_floats, k->busiest_optimizer_floats());
      double optimizer = 0, most = 0;
      for (const auto& i : e.items)
        if (i.name.starts_with("optimizer")) optimizer = i.bytes;
      for (int r = 0; r < gpus; ++r) most = std::max(most, 8 * k->rank_optimizer_floats[r] + 4 * k->rank_adamw_floats[r]);
      EXPECT_EQ(optimizer, most);
      if (opt == Optimizer::kAdamW) EXPECT_EQ(optimizer, 12 * k->busiest_optimizer_floats());
      // Muon's device workspace for its largest batch, ZAYA1's expert stack (16 x 2048 x 2048,
      // or the E / ep experts a rank holds), as keel train allocates it.
      double workspace = 0;
      for (const auto& i : e.items)
        if (i.name.starts_with("Muon workspace")) workspace = i.bytes;
      const auto at = layout.find("ep=");
      const int ep = at == std::string::npos ? 1 : std::stoi(layout.substr(at + 3));
      EXPECT_EQ(workspace, opt == Optimizer::kMuon
                               ? static_cast<double>(optim::muon_workspace_layout(16 / ep, 2048, 2048).bytes)
                               : 0.0);
    }
}

TEST(KeelTrainShards, Bf16ReduceScratchIsTheLargestStageOrTheExpertRegion) {
  auto scratch = [](const std::string& layout, int gpus, bool bf16) {
    keel::size::Setup s = setup("zaya1-8b", layout, gpus, Optimizer::kAdamW);
    s.grad_reduce_bf16 = bf16;
    return keel_train_shards(s).value().bf16_reduce_scratch;
  };
  // ZAYA1-8B: the largest stage is the embedding (262,272 x 2048; a MoE stage holds 16 experts
  // of 3 x 2048 x 2048 and the router, 202 M).
  const double embedding = 262272.0 * 2048;
  EXPECT_GE(scratch("zero=1", 8, true), embedding);
  EXPECT_LT(scratch("zero=1", 8, true), embedding + 64);
  // EP 8 on 64 GPUs: the expert region (2 experts of each of 40 layers) is reduced over 8 ranks
  // through the same scratch, and is larger.
  const double region = 40.0 * 2 * 3 * 2048 * 2048;
  EXPECT_GE(scratch("ep=8,zero=1", 64, true), region);
  EXPECT_LT(scratch("ep=8,zero=1", 64, true), region * (1 + 1e-6));
  // EP = dp: no rank shares experts, nothing of the expert region is reduced.
  EXPECT_LT(scratch("ep=16,zero=1", 16, true), embedding + 64);
  // Gradients reduced in fp32, or a single GPU: no scratch.
  EXPECT_EQ(scratch("zero=1", 8, false), 0);
  EXPECT_EQ(scratch("zero=1", 1, true), 0);
  // Tensor parallelism with data parallelism: AdamW takes the overlapped step (the tp=2
  // embedding stage, half the vocabulary), Muon the classic one (a bf16 copy of the whole
  // buffer).
  EXPECT_GE(scratch("tp=2,zero=1", 8, true), embedding / 2);
  EXPECT_LT(scratch("tp=2,zero=1", 8, true), embedding / 2 + 64);
  keel::size::Setup m = setup("zaya1-8b", "tp=2,zero=1", 8, Optimizer::kMuon);
  m.grad_reduce_bf16 = true;
  const auto k = keel_train_shards(m).value();
  double total = 0;
  for (double f : k.rank_optimizer_floats) total += f;  // the data group's shards tile the buffer
  EXPECT_NEAR(k.bf16_reduce_scratch, total, 64.0 * 4);
}

TEST(KeelTrainShards, TensorParallelLayoutsAreKeelTrainsOwn) {
  // dp=4 x tp=2: every rank holds the tp=2 layout (half of every split matrix, the routers and
  // norms whole) and a quarter of it as its ZeRO-1 shard, Muon matrices never cut.
  const auto k = keel_train_shards(setup("zaya1-8b", "tp=2,zero=1", 8, Optimizer::kMuon));
  ASSERT_TRUE(k);
  ASSERT_EQ(k->rank_optimizer_floats.size(), 4u);
  mesh::Shape m;
  m.dp = 4, m.tp = 2;
  const double local = static_cast<double>(model::param_layout(setup("zaya1-8b", "zero=1", 1, Optimizer::kMuon).model, m).total_floats);
  const double whole = static_cast<double>(model::param_layout(setup("zaya1-8b", "zero=1", 1, Optimizer::kMuon).model).total_floats);
  EXPECT_LT(local, 0.52 * whole);  // all but the replicated norms and routers halves
  EXPECT_NEAR(k->mean_optimizer_floats(), local / 4, 1e-6 * local);
  EXPECT_LT(k->busiest_optimizer_floats(), 1.1 * local / 4);
  // The Newton-Schulz work of the whole model is done once (the split matrices on their owners).
  const auto one = keel_train_shards(setup("zaya1-8b", "zero=0", 1, Optimizer::kMuon));
  ASSERT_TRUE(one);
  EXPECT_NEAR(k->muon_flops_total, one->muon_flops_total, 0.01 * one->muon_flops_total);
}

// keel size's parameters per GPU are what keel train's layout holds (model/param_layout.cc), up
// to and past the kv heads: CCA's W_o split and the rest of CCA whole past them, gqa's k and v
// projections whole past them; the embedding vocabulary-parallel throughout.
TEST(KeelTrainShards, ParametersPastTheKvHeadsMatchTheLayout) {
  for (int tp : {2, 4, 8}) {
    const keel::size::Setup s = setup("zaya1-8b", "tp=" + std::to_string(tp), tp, Optimizer::kMuon);
    mesh::Shape m;
    m.tp = tp;
    const double layout = static_cast<double>(model::param_layout(s.model, m).total_floats);
    EXPECT_NEAR(estimate_memory(s).params_on_gpu, layout, 0.001 * layout) << "tp " << tp;
  }
  // gqa past its kv heads (Llama 3 8B, 8 kv heads, at 16): the k and v projections whole
  for (int tp : {8, 16}) {
    const keel::size::Setup s = setup("llama3-8b", "tp=" + std::to_string(tp), tp, Optimizer::kAdamW);
    mesh::Shape m;
    m.tp = tp;
    const double layout = static_cast<double>(model::param_layout(s.model, m).total_floats);
    EXPECT_NEAR(estimate_memory(s).params_on_gpu, layout, 0.001 * layout) << "llama tp " << tp;
  }
}

TEST(KeelTrainShards, LayoutsAndModelsKeelTrainDoesNotRunKeepTheGeneralFormulas) {
  EXPECT_FALSE(keel_train_shards(setup("zaya1-8b", "tsp=2,zero=1", 8, Optimizer::kMuon)));
  // 8 query heads over 8 ranks, CCA's pre-attention replicated past its 2 kv heads: keel train runs it
  EXPECT_TRUE(keel_train_shards(setup("zaya1-8b", "tp=8,zero=1", 8, Optimizer::kMuon)));
  EXPECT_FALSE(keel_train_shards(setup("zaya1-8b", "pp=2,zero=1", 8, Optimizer::kMuon)));
  EXPECT_FALSE(keel_train_shards(setup("zaya1-8b", "zero=2", 8, Optimizer::kMuon)));
  EXPECT_FALSE(keel_train_shards(setup("zaya1-8b", "zero=0", 8, Optimizer::kMuon)));
  EXPECT_TRUE(keel_train_shards(setup("zaya1-8b", "zero=0", 1, Optimizer::kMuon)));  // one GPU shards nothing
  EXPECT_TRUE(keel_train_shards(setup("lasp2-hybrid-1b", "zero=1", 8, Optimizer::kMuon)));  // linear attention trains
  EXPECT_FALSE(keel_train_shards(setup("olmoe-1b-7b", "zero=1", 8, Optimizer::kMuon)));      // qk_norm
  EXPECT_EQ(estimate_memory(setup("zaya1-8b", "tsp=2,zero=1", 8, Optimizer::kMuon)).keel_train_optimizer_floats, 0);
}

}  // namespace
}  // namespace keel::size

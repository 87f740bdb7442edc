// TSP (parallel/tsp.h) at the model level on CPU ranks under MPI (2, 3 and 4 ranks, D = the
// world): after one forward and backward every parameter's gradient block equals the block of
// the one-rank gradient within 1e-5 of the tensor's largest element (replicated parameters after
// their sum over the group, as the optimizer step makes it), for the tiny MoE (untied head) and,
// at D = 2, the ZAYA1-shaped tiny model (CCA, MLP router with the skip class, residual scaling,
// tied embeddings); and no position's loss changes when a later token does (causality across
// chunk and rank boundaries), while an earlier token's change does show.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "../train/train_mpi_test_util.h"
#include "../train/train_test_util.h"
#include "model/param_layout.h"
#include "parallel/mesh.h"
#include "parallel/tensor_parallel.h"
#include "train/model.h"

namespace keel::train {
namespace {

using keel::test::world_size;

constexpr int kBatch = 2, kSeq = 24;  // 24 tokens: 2D chunks for D = 2, 3 and 4

// The model and options: the tiny MoE (widths D divides; untied head), or ZAYA1's tiny shape;
// vocab: a vocabulary large enough that each shard of the tables travels in several pieces
// (TspShards: pieces no larger than a layer's shard), or 0 for the fixture's 24.
// tables: parallel.tsp_tables (TspTables::kSweep: the rows travel in pieces; kGather: the tokens).
std::pair<model::ModelConfig, ModelOptions> setup(int d, bool zaya, int vocab = 0,
                                                  parallel::TspTables tables = parallel::TspTables::kSweep) {
  std::vector<std::string> sets = {"data.seq_length=24", "model.tied_embeddings=false"};
  if (d == 3)
    sets.insert(sets.end(), {"model.hidden=24", "model.heads=6", "model.kv_heads=3", "model.ffn_hidden=24",
                             "model.expert_hidden=12"});
  if (zaya) sets = fixtures::joined(fixtures::kZaya, {"data.seq_length=24"});
  if (vocab > 0) sets.push_back("model.vocab_size=" + std::to_string(vocab));
  const TrainConfig c =
      parse_train_config(fixtures::train_config_text("/nonexistent/d", "/tmp/keel-tsp-model"), "t.yaml", sets);
  ModelOptions o = c.model_options;
  o.micro_batch = kBatch;
  o.seq_length = kSeq;
  o.tsp_tables = tables;
  return {c.model, o};
}

parallel::Mesh tsp_mesh(int d) {
  mesh::Shape s;
  s.tsp = d;
  s.dp = world_size() / d;
  return parallel::Mesh(s, MPI_COMM_WORLD);
}

void expect_gradients_match(bool zaya, int vocab = 0, parallel::TspTables tables = parallel::TspTables::kSweep) {
  const int d = zaya ? 2 : world_size();
  if (world_size() % d != 0) GTEST_SKIP();
  const auto [cfg, o] = setup(d, zaya, vocab, tables);
  const parallel::Mesh mesh = tsp_mesh(d);
  MoeTransformer one(cfg, o), tsp(cfg, o, mesh);
  const fixtures::Batch b = fixtures::random_batch(kBatch * kSeq, static_cast<int>(cfg.vocab_size), 11, 7);
  one.zero_grads();
  tsp.zero_grads();
  const LossParts want = one.forward(b.tokens.data(), b.targets.data());
  const LossParts got = tsp.forward(b.tokens.data(), b.targets.data());
  EXPECT_NEAR(got.total, want.total, 1e-5 * std::fabs(want.total));
  one.backward(1.f);
  tsp.backward(1.f);
  // The replicated parameters' partial gradients summed over the group, as the step does.
  const parallel::TensorGroup group(mesh.group(parallel::GroupKind::kTsp).comm);
  parallel::reduce_partial_gradients(group, tsp.layout(), /*sequence=*/true, tsp.grads());
  const mesh::Shape ws = model::weight_shape(mesh.shape());
  const mesh::Coord wc = model::weight_coord(mesh.shape(), mesh.coord());
  int checked = 0;
  for (const auto& p : tsp.layout().params) {
    const Tensor whole = one.grad(p.name), mine = tsp.grad(p.name);
    double scale = 0, worst = 0;
    for (std::int64_t i = 0; i < whole.numel(); ++i) scale = std::max(scale, double(std::fabs(whole[i])));
    // every element of this rank's block against the same element of the whole tensor
    std::int64_t inner = 1;
    for (std::size_t k = 1; k < p.shape.size(); ++k) inner *= p.shape[k];
    for (const model::BlockPiece& pc : model::block_pieces(p, ws, wc)) {
      const std::size_t nd = p.global_shape.size();
      std::int64_t n = 1;
      for (auto e : pc.extent) n *= e;
      for (std::int64_t e = 0; e < n; ++e) {
        std::int64_t rest = e, local = 0, global = 0, lstride = 1, gstride = 1;
        for (std::size_t k = nd; k-- > 0;) {
          const std::int64_t i = rest % pc.extent[k];
          rest /= pc.extent[k];
          local += (k == 0 ? pc.local_row + i : i) * lstride;
          global += (pc.offset[k] + i) * gstride;
          lstride *= p.shape[k];
          gstride *= p.global_shape[k];
        }
        worst = std::max(worst, std::fabs(double(mine[local]) - whole[global]));
      }
    }
    EXPECT_LE(worst, 1e-5 * std::max(scale, 1e-6)) << p.name << " (largest " << scale << ")";
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

TEST(TspModel, GradientsPerParameterMatchOneRank) { expect_gradients_match(false); }
TEST(TspModel, ZayaGradientsPerParameterMatchOneRank) { expect_gradients_match(true); }
// 4,104 rows (divisible by 2, 3 and 4): each shard of the embedding and of the untied head (tiny
// MoE), or of the tied table (ZAYA1), travels in pieces of 64-96 rows
TEST(TspModel, TablesInPiecesMatchOneRank) { expect_gradients_match(false, 4104); }
TEST(TspModel, ZayaTiedTableInPiecesMatchesOneRank) { expect_gradients_match(true, 4104); }
// The rows stay and the tokens travel (parallel.tsp_tables: gather), untied and tied, with targets
// ignored here and there (the mean over the micro-batch's valid targets).
TEST(TspModel, GatheredTablesMatchOneRank) { expect_gradients_match(false, 4104, parallel::TspTables::kGather); }
TEST(TspModel, ZayaGatheredTiedTableMatchesOneRank) { expect_gradients_match(true, 0, parallel::TspTables::kGather); }

// The loss over positions before p (targets at p and later ignored) must not move when token p
// changes, at every p: chunk and rank boundaries included; changing token p - 1 must move it.
void expect_causal(bool zaya, parallel::TspTables tables = parallel::TspTables::kSweep) {
  const int d = zaya ? 2 : world_size();
  if (world_size() % d != 0) GTEST_SKIP();
  const auto [cfg, o] = setup(d, zaya, 0, tables);
  MoeTransformer tsp(cfg, o, tsp_mesh(d));
  const fixtures::Batch b = fixtures::random_batch(kBatch * kSeq, static_cast<int>(cfg.vocab_size), 5);
  const std::uint32_t V = static_cast<std::uint32_t>(cfg.vocab_size);
  for (int p = 1; p < kSeq; ++p) {
    std::vector<std::int32_t> targets = b.targets;
    for (int s = 0; s < kBatch; ++s)
      for (int t = p; t < kSeq; ++t) targets[static_cast<std::size_t>(s * kSeq + t)] = -1;
    const double base = tsp.forward(b.tokens.data(), targets.data()).ce;
    std::vector<std::uint32_t> later = b.tokens, earlier = b.tokens;
    for (int s = 0; s < kBatch; ++s) {
      later[static_cast<std::size_t>(s * kSeq + p)] = (b.tokens[static_cast<std::size_t>(s * kSeq + p)] + 1) % V;
      earlier[static_cast<std::size_t>(s * kSeq + p - 1)] = (b.tokens[static_cast<std::size_t>(s * kSeq + p - 1)] + 1) % V;
    }
    EXPECT_EQ(tsp.forward(later.data(), targets.data()).ce, base) << "token " << p << " reached an earlier position";
    EXPECT_NE(tsp.forward(earlier.data(), targets.data()).ce, base) << "token " << p - 1 << " changed nothing";
  }
}

TEST(TspModel, NoTokenReachesAnEarlierPosition) { expect_causal(false); }
TEST(TspModel, ZayaNoTokenReachesAnEarlierPosition) { expect_causal(true); }
TEST(TspModel, GatheredTablesLetNoTokenReachAnEarlierPosition) { expect_causal(false, parallel::TspTables::kGather); }

}  // namespace
}  // namespace keel::train

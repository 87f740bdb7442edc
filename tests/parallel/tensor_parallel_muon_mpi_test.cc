// Tensor-parallel Muon (parallel/tensor_parallel_muon.h) on CPU ranks under MPI (run at 1, 2, 3
// and 4 ranks, the tensor group being the world): every rank's updated block of the parameter
// and momentum, and its block of k * O, equal the corresponding block of optim::muon_matrix_step
// on the whole matrices, for row and column splits, single matrices and stacks, row parts,
// Nesterov on and off, decay on and off, grad_scale != 1, wide and tall matrices and every owner;
// and TensorParallelMuon::step over a tensor-parallel layout equals optim::Muon::step over the
// whole layout, the owners rotating over the parameters.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "../mpi_test_util.h"
#include "common/error.h"
#include "mesh/placement.h"
#include "optim/muon.h"
#include "optim/param_groups.h"
#include "parallel/tensor_parallel_muon.h"

namespace keel::parallel {
namespace {

using keel::test::world_rank;
using keel::test::world_size;

struct Lcg {
  std::uint64_t s;
  float next() {  // uniform in [-1, 1)
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>((s >> 40) * (1.0 / 8388608.0)) - 1.f;
  }
};

std::vector<float> random_vec(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  Lcg g{seed};
  std::vector<float> v(n);
  for (auto& x : v) x = scale * g.next();
  return v;
}

// Rank r's block of a stack of E whole R x C matrices split over T ranks, written from the
// definition of the split (independently of the library's copy code): split 0 takes rows
// (rank r's slice of every row part, in order), split 1 columns.
std::vector<float> block_of(const std::vector<float>& whole, std::int64_t E, std::int64_t R, std::int64_t C, int split,
                            const std::vector<std::int64_t>& parts_in, int T, int r) {
  std::vector<float> out;
  for (std::int64_t e = 0; e < E; ++e) {
    const float* w = whole.data() + e * R * C;
    if (split == kTpSplitCols) {
      const std::int64_t lc = C / T;
      for (std::int64_t i = 0; i < R; ++i)
        for (std::int64_t j = 0; j < lc; ++j) out.push_back(w[i * C + r * lc + j]);
    } else {
      std::vector<std::int64_t> parts = parts_in.empty() ? std::vector<std::int64_t>{R} : parts_in;
      std::int64_t start = 0;
      for (std::int64_t part : parts) {
        const std::int64_t n = part / T;
        for (std::int64_t i = start + r * n; i < start + (r + 1) * n; ++i)
          for (std::int64_t j = 0; j < C; ++j) out.push_back(w[i * C + j]);
        start += part;
      }
    }
  }
  return out;
}

constexpr float kDistributedTol = 1e-4f;

// Within tol relative (relative to 1e-2 for elements below it).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what,
                  float tol = 1e-5f) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(std::fabs(want[i]), 1e-2f))
        << what << ", rank " << world_rank() << " of " << world_size() << ", element " << i;
}

struct Case {
  std::int64_t E, R, C;  // whole matrices
  int split;
  std::vector<std::int64_t> parts;
  bool nesterov, decay;
  optim::MuonScale scale;
  int owner;
  std::uint64_t seed;
  bool distributed = false;  // tp_muon_matrix_step_distributed instead of the gather version
};

std::string describe(const Case& k) {
  return fmt::format("E={} {}x{} split={} parts={} nesterov={} decay={} scale={} owner={}", k.E, k.R, k.C, k.split,
                     k.parts.size(), k.nesterov, k.decay, static_cast<int>(k.scale), k.owner);
}

// Runs one case: the single-rank step on the whole stack (every rank, the same inputs) and the
// tensor-parallel step on this rank's blocks; compares param, momentum and k * O blocks.
void check_case(const Case& k) {
  const int T = world_size(), r = world_rank();
  optim::MuonConfig c;
  c.nesterov = k.nesterov;
  c.scale = k.scale;
  c.momentum = 0.9;
  c.weight_decay = 0.1;
  const double lr = 0.05;
  const float grad_scale = 0.37f;
  const std::size_t n = static_cast<std::size_t>(k.E * k.R * k.C);
  auto param = random_vec(n, k.seed), grad = random_vec(n, k.seed + 1, 3.f), mom = random_vec(n, k.seed + 2, 0.5f);

  // The local blocks, before the whole step updates param and mom in place.
  auto lp = block_of(param, k.E, k.R, k.C, k.split, k.parts, T, r);
  auto lg = block_of(grad, k.E, k.R, k.C, k.split, k.parts, T, r);
  auto lm = block_of(mom, k.E, k.R, k.C, k.split, k.parts, T, r);

  std::vector<float> scratch(static_cast<std::size_t>(optim::muon_scratch_floats(k.R, k.C))), upd(n);
  optim::muon_matrix_step(param.data(), grad.data(), mom.data(), k.E, k.R, k.C, c, lr, k.decay, grad_scale,
                          scratch.data(), upd.data());

  const std::int64_t lr_ = k.split == kTpSplitRows ? k.R / T : k.R, lc = k.split == kTpSplitCols ? k.C / T : k.C;
  std::vector<float> lu(lp.size(), -7.f);
  if (k.distributed) {
    std::vector<float> tps(static_cast<std::size_t>(tp_muon_distributed_scratch_floats(lr_, lc, k.split, T)), 12345.f);
    tp_muon_matrix_step_distributed(lp.data(), lg.data(), lm.data(), k.E, lr_, lc, k.split, c, lr, k.decay,
                                    grad_scale, MPI_COMM_WORLD, tps.data(), k.parts, lu.data());
  } else {
    std::vector<float> tps(static_cast<std::size_t>(tp_muon_scratch_floats(k.E, lr_, lc, k.split, T)), 12345.f);
    const std::int64_t done = tp_muon_matrix_step(lp.data(), lg.data(), lm.data(), k.E, lr_, lc, k.split, c, lr,
                                                  k.decay, grad_scale, k.owner, MPI_COMM_WORLD, tps.data(), k.parts,
                                                  lu.data());
    // Matrix e on rank (owner + e) % T.
    std::int64_t mine = 0;
    for (std::int64_t e = 0; e < k.E; ++e) mine += (k.owner + e) % T == r;
    EXPECT_EQ(done, mine) << describe(k) << ", rank " << r;
  }

  // The gather version runs the very same floats as the whole step; the distributed one sums
  // partial Gram matrices across ranks (fp32 rounding through 5 NS iterations).
  const float tol = k.distributed ? kDistributedTol : 1e-5f;
  const std::string what = describe(k) + (k.distributed ? " distributed" : "");
  expect_close(lp, block_of(param, k.E, k.R, k.C, k.split, k.parts, T, r), "param " + what, tol);
  expect_close(lm, block_of(mom, k.E, k.R, k.C, k.split, k.parts, T, r), "momentum " + what, tol);
  expect_close(lu, block_of(upd, k.E, k.R, k.C, k.split, k.parts, T, r), "k*O " + what, tol);
}

// The whole matrices: 24 x 48 (wide) and 48 x 24 (tall, Newton-Schulz's transposed path); every
// split is even at 1, 2, 3 and 4 ranks.
TEST(TensorParallelMuonMpi, BlocksMatchWholeMatrixStep) {
  const int T = world_size();
  std::uint64_t seed = 1000;
  int cases = 0;
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{24, 48}, {48, 24}})
    for (int split : {kTpSplitRows, kTpSplitCols})
      for (std::int64_t E : {1, 3})
        for (bool nesterov : {true, false})
          for (bool decay : {true, false})
            for (auto scale : {optim::MuonScale::kMatchAdamW, optim::MuonScale::kExactRms}) {
              check_case({E, R, C, split, {}, nesterov, decay, scale, cases % T, seed});
              if (HasFatalFailure()) return;
              seed += 10;
              ++cases;
            }
  EXPECT_EQ(cases, 64);
}

// Every rank as the owner, for a single matrix and a stack of 5 (more matrices than ranks: the
// owners wrap around), both splits.
TEST(TensorParallelMuonMpi, EveryOwnerGivesTheSameResult) {
  const int T = world_size();
  for (int owner = 0; owner < T; ++owner)
    for (std::int64_t E : {1, 5})
      for (int split : {kTpSplitRows, kTpSplitCols}) {
        check_case({E, 36, 24, split, {}, true, true, optim::MuonScale::kKeller, owner, 77u + owner});
        if (HasFatalFailure()) return;
      }
}

// A fused [q; k] row split (Placement::parts {24, 12}): each rank's block is its q rows then its
// k rows; the whole matrix Newton-Schulz sees is q then k.
TEST(TensorParallelMuonMpi, RowPartsReassembleInOrder) {
  for (std::int64_t E : {1, 2})
    for (bool nesterov : {true, false}) {
      check_case({E, 36, 24, kTpSplitRows, {24, 12}, nesterov, true, optim::MuonScale::kMatchAdamW, 0, 500u});
      if (HasFatalFailure()) return;
    }
}

// Newton-Schulz distributed over the group (splits along the long dimension, squares both
// ways), against the whole step.
TEST(TensorParallelMuonMpi, DistributedNewtonSchulzMatchesWholeMatrixStep) {
  const int T = world_size();
  int cases = 0;
  std::uint64_t seed = 3000;
  for (auto [R, C, split] : {std::tuple<std::int64_t, std::int64_t, int>{48, 24, kTpSplitRows},
                             {24, 48, kTpSplitCols},
                             {24, 24, kTpSplitRows},
                             {24, 24, kTpSplitCols}})
    for (std::int64_t E : {1, 3})
      for (bool nesterov : {true, false})
        for (auto scale : {optim::MuonScale::kMatchAdamW, optim::MuonScale::kExactRms}) {
          ASSERT_TRUE(tp_muon_can_distribute(split == kTpSplitRows ? R / T : R, split == kTpSplitCols ? C / T : C,
                                             split, T));
          Case k{E, R, C, split, {}, nesterov, E == 1, scale, 0, seed += 10};
          k.distributed = true;
          check_case(k);
          if (HasFatalFailure()) return;
          ++cases;
        }
  // Row parts of a tall fused matrix.
  Case parts{2, 36, 24, kTpSplitRows, {24, 12}, true, true, optim::MuonScale::kMatchAdamW, 0, 4000u};
  parts.distributed = true;
  check_case(parts);
  EXPECT_EQ(cases, 32);
  // Along the short dimension it refuses (at one rank every split is whole: it may run).
  if (T > 1) {
    EXPECT_TRUE(tp_muon_can_distribute(48 / T, 24, kTpSplitRows, T));
    EXPECT_FALSE(tp_muon_can_distribute(24 / T, 48, kTpSplitRows, T));
    EXPECT_FALSE(tp_muon_can_distribute(48, 24 / T, kTpSplitCols, T));
    std::vector<float> p(24 * 48 / T), g(p.size()), m(p.size()),
        s(static_cast<std::size_t>(tp_muon_distributed_scratch_floats(24 / T, 48, kTpSplitRows, T)));
    EXPECT_THROW(tp_muon_matrix_step_distributed(p.data(), g.data(), m.data(), 1, 24 / T, 48, kTpSplitRows,
                                                 optim::MuonConfig{}, 0.01, true, 1.f, MPI_COMM_WORLD, s.data()),
                 Error);
  }
}

TEST(TensorParallelMuonMpi, OwnersRotate) {
  const int T = world_size();
  for (int i = 0; i < 2 * T + 1; ++i) EXPECT_EQ(tp_muon_owner(i, T), i % T);
  // Two consecutive parameters get different owners whenever there are several ranks.
  if (T > 1) EXPECT_NE(tp_muon_owner(0, T), tp_muon_owner(1, T));
  // Two parameters stepped with those owners, one after the other, are both exact, and each was
  // orthogonalized on its owner alone (check_case checks the count every rank reports).
  check_case({1, 24, 48, kTpSplitRows, {}, true, true, optim::MuonScale::kMatchAdamW, tp_muon_owner(0, T), 900u});
  check_case({1, 48, 24, kTpSplitCols, {}, true, true, optim::MuonScale::kMatchAdamW, tp_muon_owner(1, T), 901u});
}

// A batch of differently shaped tensors (row and column splits, a stack, row parts, its own lr
// and decay each) in one tp_muon_step_batch, balanced owners and explicit ones, against the
// whole step of each.
TEST(TensorParallelMuonMpi, BatchMatchesWholeMatrixSteps) {
  const int T = world_size(), r = world_rank();
  struct W {
    std::int64_t E, R, C;
    int split;
    std::vector<std::int64_t> parts;
    double lr;
    bool decay;
  };
  const std::vector<W> ws = {{1, 48, 24, kTpSplitRows, {}, 0.05, true},
                             {3, 24, 48, kTpSplitCols, {}, 0.02, false},
                             {1, 36, 24, kTpSplitRows, {24, 12}, 0.03, true},
                             {2, 24, 24, kTpSplitCols, {}, 0.04, true},
                             {1, 12, 12, kTpSplitRows, {}, 0.01, false}};
  optim::MuonConfig c;
  c.momentum = 0.9;
  c.nesterov = true;
  for (int explicit_owners = 0; explicit_owners < 2; ++explicit_owners) {
    std::vector<std::vector<float>> wp, wg, wm, wu, lp, lg, lm, lu;
    std::vector<TpMuonTensor> batch;
    std::uint64_t seed = 7000 + 100 * explicit_owners;
    for (const W& w : ws) {
      const auto n = static_cast<std::size_t>(w.E * w.R * w.C);
      wp.push_back(random_vec(n, ++seed));
      wg.push_back(random_vec(n, ++seed, 2.f));
      wm.push_back(random_vec(n, ++seed, 0.3f));
      wu.emplace_back(n);
      lp.push_back(block_of(wp.back(), w.E, w.R, w.C, w.split, w.parts, T, r));
      lg.push_back(block_of(wg.back(), w.E, w.R, w.C, w.split, w.parts, T, r));
      lm.push_back(block_of(wm.back(), w.E, w.R, w.C, w.split, w.parts, T, r));
      lu.emplace_back(lp.back().size(), -1.f);
      std::vector<float> scratch(static_cast<std::size_t>(optim::muon_scratch_floats(w.R, w.C)));
      optim::muon_matrix_step(wp.back().data(), wg.back().data(), wm.back().data(), w.E, w.R, w.C, c, w.lr, w.decay,
                              0.8f, scratch.data(), wu.back().data());
    }
    for (std::size_t i = 0; i < ws.size(); ++i) {
      TpMuonTensor t;
      t.param = lp[i].data();
      t.grad = lg[i].data();
      t.momentum = lm[i].data();
      t.matrices = ws[i].E;
      t.local_rows = ws[i].split == kTpSplitRows ? ws[i].R / T : ws[i].R;
      t.local_cols = ws[i].split == kTpSplitCols ? ws[i].C / T : ws[i].C;
      t.split_dim = ws[i].split;
      t.row_parts = ws[i].parts;
      t.lr = ws[i].lr;
      t.decay = ws[i].decay;
      t.update_out = lu[i].data();
      batch.push_back(t);
    }
    std::vector<int> owners;  // 8 matrices: all on the last rank but every third on rank 0
    if (explicit_owners)
      for (int j = 0; j < 8; ++j) owners.push_back(j % 3 == 0 ? 0 : T - 1);
    std::vector<float> workspace;
    const std::int64_t done = tp_muon_step_batch(batch, c, 0.8f, MPI_COMM_WORLD, workspace, owners);
    const auto used = owners.empty() ? tp_muon_balance_owners(batch, T) : owners;
    EXPECT_EQ(done, std::count(used.begin(), used.end(), r)) << "rank " << r;
    std::int64_t all = done;
    MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    EXPECT_EQ(all, 8);
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const W& w = ws[i];
      const std::string what = fmt::format("tensor {} (owners {})", i, explicit_owners ? "given" : "balanced");
      expect_close(lp[i], block_of(wp[i], w.E, w.R, w.C, w.split, w.parts, T, r), "param " + what);
      expect_close(lm[i], block_of(wm[i], w.E, w.R, w.C, w.split, w.parts, T, r), "momentum " + what);
      expect_close(lu[i], block_of(wu[i], w.E, w.R, w.C, w.split, w.parts, T, r), "k*O " + what);
      if (HasFatalFailure()) return;
    }
  }
}

// Balanced owners: equal matrices spread one per rank, then wrap; a big matrix takes a rank
// alone while small ones fill the others.
TEST(TensorParallelMuonMpi, BalancedOwnersSpreadTheWork) {
  const int T = world_size();
  std::vector<TpMuonTensor> equal(1);
  equal[0].matrices = 2 * T;
  equal[0].local_rows = 24 / T;
  equal[0].local_cols = 24;
  const auto owners = tp_muon_balance_owners(equal, T);
  ASSERT_EQ(owners.size(), static_cast<std::size_t>(2 * T));
  std::vector<int> per_rank(static_cast<std::size_t>(T), 0);
  for (int o : owners) ++per_rank[static_cast<std::size_t>(o)];
  for (int d = 0; d < T; ++d) EXPECT_EQ(per_rank[static_cast<std::size_t>(d)], 2) << "rank " << d;
  if (T > 1) {
    std::vector<TpMuonTensor> mixed(2);
    mixed[0].matrices = T - 1;  // small ones first in the batch
    mixed[0].local_rows = 12 / T;
    mixed[0].local_cols = 12;
    mixed[1].matrices = 1;  // one large one: 64x more NS FLOPs than a small one
    mixed[1].local_rows = 48 / T;
    mixed[1].local_cols = 48;
    const auto o = tp_muon_balance_owners(mixed, T);
    ASSERT_EQ(o.size(), static_cast<std::size_t>(T));
    EXPECT_EQ(o.back(), 0);  // the large one goes first, to rank 0
    for (int j = 0; j + 1 < T; ++j) EXPECT_EQ(o[static_cast<std::size_t>(j)], j + 1) << "small matrix " << j;
  }
}

// A small tensor-parallel model layout: column- and row-parallel matrices, expert stacks split
// along dims 1 and 2, a fused [q; k] with parts, a replicated Muon matrix and an AdamW vector.
// TensorParallelMuon::step over this rank's layout equals optim::Muon::step over the whole one
// (two steps, so momentum carries over), in one batch and in batches of one parameter each.
void check_layout_step(std::int64_t max_batch_floats) {
  const int T = world_size(), r = world_rank();
  constexpr auto kTp = mesh::Axis::kTensor;
  struct P {
    std::string name;
    std::vector<std::int64_t> global;
    mesh::Placement placement;
    int split;  // -1: not split
    std::vector<std::int64_t> parts;
  };
  std::vector<P> ps = {
      {"layers.0.attn.wq", {48, 24}, mesh::Placement::split(2, 0, kTp), kTpSplitRows, {}},
      {"layers.0.attn.wo", {24, 48}, mesh::Placement::split(2, 1, kTp), kTpSplitCols, {}},
      {"layers.0.attn.cca.w_qk", {36, 24}, mesh::Placement::split_parts(2, {24, 12}, kTp), kTpSplitRows, {24, 12}},
      {"layers.0.mlp_norm.weight", {24}, mesh::Placement::replicated(1), -1, {}},
      {"layers.0.moe.router", {4, 24}, mesh::Placement::replicated(2), -1, {}},
      {"layers.0.moe.w_gate", {3, 48, 24}, mesh::Placement::split(3, 1, kTp), kTpSplitRows, {}},
      {"layers.0.moe.w_down", {3, 24, 48}, mesh::Placement::split(3, 2, kTp), kTpSplitCols, {}},
  };
  std::vector<optim::ParamSpec> whole_specs, local_specs;
  for (const auto& p : ps) {
    whole_specs.push_back({p.name, p.global, mesh::Placement::replicated(static_cast<int>(p.global.size())), p.global});
    auto local = p.global;
    if (p.split == kTpSplitRows) local[local.size() - 2] /= T;
    if (p.split == kTpSplitCols) local.back() /= T;
    local_specs.push_back({p.name, local, p.placement, p.global});
  }
  const auto rules = optim::default_rules();
  const auto wl = optim::assign_groups(whole_specs, rules), ll = optim::assign_groups(local_specs, rules);
  int muon_split = 0;
  for (const auto& p : ll.params) muon_split += p.optimizer == optim::OptimizerKind::kMuon && p.ndim() >= 2 &&
                                                tp_muon_split(p, T).split;
  ASSERT_EQ(muon_split, 5);

  optim::MuonConfig c;
  c.momentum = 0.9;
  const auto n = static_cast<std::size_t>(wl.total_floats);
  auto wp = random_vec(n, 31), wm = std::vector<float>(n, 0.f);
  std::vector<float> lp(static_cast<std::size_t>(ll.total_floats)), lm(lp.size(), 0.f), lg(lp.size());
  const auto slice = [&](const std::vector<float>& whole_buf, std::vector<float>& local_buf) {
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto& w = wl.params[i];
      const auto& l = ll.params[i];
      std::vector<float> whole(whole_buf.begin() + w.offset, whole_buf.begin() + w.offset + w.numel), block;
      if (ps[i].split < 0)
        block = whole;
      else
        block = block_of(whole, w.matrices(), w.rows(), w.cols(), ps[i].split, ps[i].parts, T, r);
      ASSERT_EQ(static_cast<std::int64_t>(block.size()), l.numel) << l.name;
      std::copy(block.begin(), block.end(), local_buf.begin() + l.offset);
    }
  };
  slice(wp, lp);
  optim::Muon whole_muon(c);
  TensorParallelMuon tp_muon(c, MPI_COMM_WORLD);
  tp_muon.set_max_batch_floats(max_batch_floats);
  EXPECT_EQ(tp_muon.tensor_size(), T);
  for (int step = 0; step < 2; ++step) {
    const auto wg = random_vec(n, 40 + step);
    slice(wg, lg);
    whole_muon.step(wl, wp.data(), wg.data(), wm.data(), 0.02 * (step + 1), 0.5f);
    tp_muon.step(ll, lp.data(), lg.data(), lm.data(), 0.02 * (step + 1), 0.5f);
  }
  EXPECT_EQ(tp_muon.step_count(), 2);
  std::vector<float> wantp(lp.size()), wantm(lp.size());
  slice(wp, wantp);
  slice(wm, wantm);
  for (const auto& l : ll.params) {
    if (l.optimizer != optim::OptimizerKind::kMuon) continue;  // AdamW's: untouched by both
    const auto b = static_cast<std::ptrdiff_t>(l.offset), e = b + static_cast<std::ptrdiff_t>(l.numel);
    expect_close({lp.begin() + b, lp.begin() + e}, {wantp.begin() + b, wantp.begin() + e}, "param " + l.name);
    expect_close({lm.begin() + b, lm.begin() + e}, {wantm.begin() + b, wantm.begin() + e}, "momentum " + l.name);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(TensorParallelMuonMpi, LayoutStepMatchesWholeMuon) { check_layout_step(std::int64_t{1} << 25); }
TEST(TensorParallelMuonMpi, LayoutStepInSmallBatchesMatchesWholeMuon) { check_layout_step(1); }

TEST(TensorParallelMuonMpi, RejectsBadArguments) {
  const int T = world_size();
  optim::MuonConfig c;
  std::vector<float> p(48 * 24), g(p.size()), m(p.size()), s(static_cast<std::size_t>(tp_muon_scratch_floats(1, 48, 24, 1, T)));
  const auto call = [&](std::int64_t rows, std::int64_t cols, int split, int owner, std::vector<std::int64_t> parts) {
    tp_muon_matrix_step(p.data(), g.data(), m.data(), 1, rows, cols, split, c, 0.01, true, 1.f, owner, MPI_COMM_WORLD,
                        s.data(), parts);
  };
  EXPECT_THROW(call(12, 24, 0, T, {}), Error);        // owner outside the group
  EXPECT_THROW(call(12, 24, 0, -1, {}), Error);
  EXPECT_THROW(call(12, 24, 2, 0, {}), Error);        // no such split
  EXPECT_THROW(call(12, 24, 1, 0, {12}), Error);      // parts with a column split
  EXPECT_THROW(call(12, 24, 0, 0, {T * 12, T}), Error);  // parts add up to more rows than the matrix has
  EXPECT_THROW(call(0, 24, 0, 0, {}), Error);
  if (T > 1) EXPECT_THROW(call(12, 24, 0, 0, {T * 12 - 1, 1}), Error);  // a part that does not split
  // A parameter split over tp along both matrix dims, or over another axis.
  optim::ParamInfo both;
  both.name = "w";
  both.shape = {4, 4};
  both.placement = mesh::Placement::split(2, 0, mesh::Axis::kTensor);
  both.placement.dims[1].push_back(mesh::Axis::kTensor);
  EXPECT_THROW(tp_muon_split(both, T), Error);
  optim::ParamInfo other = both;
  other.placement = mesh::Placement::split(2, 1, mesh::Axis::kTsp);
  EXPECT_THROW(tp_muon_split(other, T), Error);
  // Experts split over tp (dim 0 of a stack): every matrix whole here, a local step.
  optim::ParamInfo experts = both;
  experts.shape = {2, 4, 4};
  experts.placement = mesh::Placement::split(3, 0, mesh::Axis::kTensor);
  EXPECT_FALSE(tp_muon_split(experts, T).split);
}

// Timings, not a check (run by hand: --gtest_also_run_disabled_tests --gtest_filter='*Bench*',
// OPENBLAS_NUM_THREADS=1 for one core per rank), for 1 and for T matrices of 512 x 512 and
// 2048 x 512, both splits: gather-to-owner as one stack (one call, owners rotating over the
// stack), as separate single-matrix calls (owners rotating from call to call), as one
// tp_muon_step_batch of single-matrix tensors, and distributed Newton-Schulz. Rank 0 prints the
// median over 5 runs of the slowest rank's time.
TEST(TensorParallelMuonMpi, DISABLED_BenchGatherVsDistributed) {
  const int T = world_size(), r = world_rank();
  optim::MuonConfig c;
  const auto time_it = [&](auto&& fn) {
    std::vector<double> ts;
    for (int rep = 0; rep < 6; ++rep) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      fn();
      double t = MPI_Wtime() - t0;
      MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (rep > 0) ts.push_back(t);  // the first warms up
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2] * 1e3;
  };
  if (r == 0) std::printf("ranks %d: ms per step (slowest rank, median of 5)\n", T);
  for (auto [R, C] : {std::pair<std::int64_t, std::int64_t>{512, 512}, {2048, 512}}) {
    // The single-rank step on one whole matrix, for scale.
    {
      std::vector<float> p = random_vec(static_cast<std::size_t>(R * C), 1), g = random_vec(p.size(), 2),
                         m(p.size(), 0.f), s(static_cast<std::size_t>(optim::muon_scratch_floats(R, C)));
      const double t = time_it([&] {
        optim::muon_matrix_step(p.data(), g.data(), m.data(), 1, R, C, c, 0.01, true, 1.f, s.data());
      });
      if (r == 0) std::printf("  %4lldx%-4lld whole matrix, one rank alone      : %8.2f\n", (long long)R, (long long)C, t);
    }
    for (int split : {kTpSplitRows, kTpSplitCols}) {
      const std::int64_t lr = split == kTpSplitRows ? R / T : R, lc = split == kTpSplitCols ? C / T : C;
      for (std::int64_t E : {std::int64_t{1}, std::int64_t{T}}) {
        std::vector<float> p = random_vec(static_cast<std::size_t>(E * lr * lc), 1), g = random_vec(p.size(), 2),
                           m(p.size(), 0.f);
        std::vector<float> s(static_cast<std::size_t>(tp_muon_scratch_floats(E, lr, lc, split, T)));
        const double tg = time_it([&] {
          tp_muon_matrix_step(p.data(), g.data(), m.data(), E, lr, lc, split, c, 0.01, true, 1.f, 0, MPI_COMM_WORLD,
                              s.data());
        });
        double td = -1;
        if (tp_muon_can_distribute(lr, lc, split, T)) {
          std::vector<float> sd(static_cast<std::size_t>(tp_muon_distributed_scratch_floats(lr, lc, split, T)));
          td = time_it([&] {
            tp_muon_matrix_step_distributed(p.data(), g.data(), m.data(), E, lr, lc, split, c, 0.01, true, 1.f,
                                            MPI_COMM_WORLD, sd.data());
          });
        }
        // E separate single-matrix tensors: one call each (owners rotating) and one batch.
        std::vector<std::vector<float>> sp, sg, sm;
        std::vector<TpMuonTensor> batch;
        for (std::int64_t i = 0; i < E; ++i) {
          sp.push_back(random_vec(static_cast<std::size_t>(lr * lc), 10 + i));
          sg.push_back(random_vec(sp.back().size(), 20 + i));
          sm.emplace_back(sp.back().size(), 0.f);
        }
        for (std::int64_t i = 0; i < E; ++i) {
          TpMuonTensor t;
          t.param = sp[i].data();
          t.grad = sg[i].data();
          t.momentum = sm[i].data();
          t.local_rows = lr;
          t.local_cols = lc;
          t.split_dim = split;
          t.lr = 0.01;
          batch.push_back(t);
        }
        std::vector<float> s1(static_cast<std::size_t>(tp_muon_scratch_floats(1, lr, lc, split, T))), ws;
        const double tcalls = time_it([&] {
          for (std::int64_t i = 0; i < E; ++i)
            tp_muon_matrix_step(sp[i].data(), sg[i].data(), sm[i].data(), 1, lr, lc, split, c, 0.01, true, 1.f,
                                tp_muon_owner(i, T), MPI_COMM_WORLD, s1.data());
        });
        const double tbatch = time_it([&] { tp_muon_step_batch(batch, c, 1.f, MPI_COMM_WORLD, ws); });
        if (r == 0)
          std::printf("  %4lldx%-4lld split %-4s x%lld: stack %8.2f  calls %8.2f  batch %8.2f  distributed %s\n",
                      (long long)R, (long long)C, split == kTpSplitRows ? "rows" : "cols", (long long)E, tg, tcalls,
                      tbatch, td < 0 ? "n/a (short dim)" : fmt::format("{:8.2f}", td).c_str());
      }
    }
  }
}

}  // namespace
}  // namespace keel::parallel

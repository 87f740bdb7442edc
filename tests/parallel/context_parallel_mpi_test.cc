// parallel::ContextParallel on CPU ranks (run at 2, 3 and 4 ranks; the world one context group),
// on fresh random inputs every rank draws alike: its zigzag rows of the whole-sequence results.
//   - attention (gathered keys, and the ring): out, lse, dq of this rank's rows, and dk, dv summed
//     back to the rank holding the keys, against ops::attention on whole sequences; full causal
//     and a sliding window that crosses chunk boundaries;
//   - halos: each run receives the tail of the chunk before it in the sequence (zeros at the
//     start), and halo_backward is its adjoint;
//   - CCA over the split (halos for its convolutions and value shift, gathered keys): y, dx and
//     the parameter gradients (summed over the ranks) against the whole-sequence op; and
//     causality across rank boundaries: perturbing the token at the first position of either of
//     a rank's chunks changes no output at an earlier position, and does change later ones;
//   - LASP-2 (linear attention, gathered memory states) and LASP-1 (the ring mode's states passed
//     rank to rank): out, dq, dk, dv of this rank's rows
//     against ops::linear_attention on whole sequences, with and without decay, a chunk that
//     does and does not divide the runs; and causality at every position of the sequence.
#include "parallel/context_parallel.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "../ops/gradcheck.h"
#include "common/error.h"
#include "ops/attention.h"
#include "ops/cca.h"
#include "ops/linear_attention.h"

namespace keel::parallel {
namespace {

using keel::test::random_vector;
using keel::test::world_rank;
using keel::test::world_size;

// Rows [B, S, W] of a whole-sequence tensor -> this rank's [B, S/C, W] (zigzag order).
std::vector<float> local_rows(const std::vector<float>& whole, std::int64_t B, std::int64_t S, std::int64_t W,
                              const std::vector<std::int32_t>& pos) {
  const std::int64_t T = static_cast<std::int64_t>(pos.size());
  std::vector<float> out(static_cast<std::size_t>(B * T * W));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t w = 0; w < W; ++w) out[(b * T + t) * W + w] = whole[(b * S + pos[t]) * W + w];
  return out;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

TEST(ContextParallelCore, ZigzagPositions) {
  EXPECT_EQ(zigzag_positions(8, 2, 0), (std::vector<std::int32_t>{0, 1, 6, 7}));
  EXPECT_EQ(zigzag_positions(8, 2, 1), (std::vector<std::int32_t>{2, 3, 4, 5}));
  EXPECT_EQ(zigzag_positions(12, 3, 2), (std::vector<std::int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(zigzag_positions(4, 1, 0), (std::vector<std::int32_t>{0, 1, 2, 3}));
  EXPECT_THROW(check_context_split(10, 3, 1, "x"), UsageError);
  EXPECT_THROW(check_context_split(12, 3, 3, "x"), UsageError);
  EXPECT_NO_THROW(check_context_split(12, 3, 2, "x"));
}

void expect_attention_matches_whole_sequences(ContextMode mode) {
  const int C = world_size();
  // by heads (alltoall) each rank takes 1/C of the query and kv heads: 2 kv heads per rank
  const std::int64_t B = 2, S = 2 * C * 3, Hkv = mode == ContextMode::kAllToAll ? 2 * C : 2, Hq = 2 * Hkv, D = 8;
  ContextParallel cp(MPI_COMM_WORLD, S, mode);
  ASSERT_EQ(cp.ring(), mode == ContextMode::kRing);
  ASSERT_EQ(cp.mode(), mode);
  const auto& pos = cp.positions();
  const std::int64_t T = S / C;
  for (int window : {0, 5}) {
    const std::uint32_t seed = 100 + window;
    const auto q = random_vector(B * S * Hq * D, seed), k = random_vector(B * S * Hkv * D, seed + 1),
               v = random_vector(B * S * Hkv * D, seed + 2), dout = random_vector(B * S * Hq * D, seed + 3);
    std::vector<float> out(q.size()), lse(B * Hq * S), dq(q.size()), dk(k.size()), dv(v.size());
    ops::attention::forward(Tensor(const_cast<float*>(q.data()), {B, S, Hq, D}),
                            Tensor(const_cast<float*>(k.data()), {B, S, Hkv, D}),
                            Tensor(const_cast<float*>(v.data()), {B, S, Hkv, D}), 0.3f, Tensor(out.data(), {B, S, Hq, D}),
                            Tensor(lse.data(), {B, Hq, S}), window);
    ops::attention::backward(Tensor(const_cast<float*>(q.data()), {B, S, Hq, D}),
                             Tensor(const_cast<float*>(k.data()), {B, S, Hkv, D}),
                             Tensor(const_cast<float*>(v.data()), {B, S, Hkv, D}), Tensor(out.data(), {B, S, Hq, D}),
                             Tensor(lse.data(), {B, Hq, S}), Tensor(const_cast<float*>(dout.data()), {B, S, Hq, D}),
                             0.3f, Tensor(dq.data(), {B, S, Hq, D}), Tensor(dk.data(), {B, S, Hkv, D}),
                             Tensor(dv.data(), {B, S, Hkv, D}), window);
    auto lq = local_rows(q, B, S, Hq * D, pos), lk = local_rows(k, B, S, Hkv * D, pos),
         lv = local_rows(v, B, S, Hkv * D, pos), ldout = local_rows(dout, B, S, Hq * D, pos);
    std::vector<float> lout(lq.size()), llse(B * Hq * T), ldq(lq.size()), ldk(lk.size()), ldv(lv.size());
    cp.attend(Tensor(lq.data(), {B, T, Hq, D}), Tensor(lk.data(), {B, T, Hkv, D}), Tensor(lv.data(), {B, T, Hkv, D}),
              0.3f, window, Tensor(lout.data(), {B, T, Hq, D}), Tensor(llse.data(), {B, Hq, T}));
    EXPECT_LT(max_diff(lout, local_rows(out, B, S, Hq * D, pos)), 1e-6) << window;
    // lse is [B, Hq, T]: compare per (b, h) row
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t t = 0; t < T; ++t)
          EXPECT_NEAR(llse[(b * Hq + h) * T + t], lse[(b * Hq + h) * S + pos[t]], 1e-5) << window;
    cp.attend_backward(Tensor(lq.data(), {B, T, Hq, D}), Tensor(lk.data(), {B, T, Hkv, D}),
                       Tensor(lv.data(), {B, T, Hkv, D}), Tensor(lout.data(), {B, T, Hq, D}),
                       Tensor(llse.data(), {B, Hq, T}), Tensor(ldout.data(), {B, T, Hq, D}), 0.3f, window,
                       Tensor(ldq.data(), {B, T, Hq, D}), Tensor(ldk.data(), {B, T, Hkv, D}),
                       Tensor(ldv.data(), {B, T, Hkv, D}));
    EXPECT_LT(max_diff(ldq, local_rows(dq, B, S, Hq * D, pos)), 1e-5) << window;
    EXPECT_LT(max_diff(ldk, local_rows(dk, B, S, Hkv * D, pos)), 1e-5) << window;
    EXPECT_LT(max_diff(ldv, local_rows(dv, B, S, Hkv * D, pos)), 1e-5) << window;
  }
}

TEST(ContextParallelCore, AttentionMatchesWholeSequences) {
  expect_attention_matches_whole_sequences(ContextMode::kAllGather);
}
// The ring (parallel.context_mode: ring): every rank's block of k, v visits each rank in turn,
// merged by log-sum-exp; backward carries each block's dk, dv around and home.
TEST(ContextParallelCore, RingAttentionMatchesWholeSequences) {
  expect_attention_matches_whole_sequences(ContextMode::kRing);
}
// By heads (parallel.context_mode: alltoall): one all-to-all to whole sequences of 1/C of the
// heads, the plain op, one all-to-all back; backward likewise.
TEST(ContextParallelCore, AllToAllAttentionMatchesWholeSequences) {
  expect_attention_matches_whole_sequences(ContextMode::kAllToAll);
}
TEST(ContextParallelCore, ContextModeWords) {
  EXPECT_EQ(parse_context_mode("alltoall"), ContextMode::kAllToAll);
  EXPECT_EQ(parse_context_mode("ring"), ContextMode::kRing);
  EXPECT_STREQ(context_mode_name(parse_context_mode("allgather")), "allgather");
  EXPECT_THROW(parse_context_mode("ulysses"), UsageError);
}

TEST(ContextParallelCore, HalosAreThePrecedingChunksTailsAndBackwardIsTheAdjoint) {
  const int C = world_size(), r = world_rank();
  const std::int64_t B = 2, F = 3, S = 2 * C * 2;
  ContextParallel cp(MPI_COMM_WORLD, S);
  // tail of (sequence b, chunk c) = 1000 b + 10 c + f
  const auto tail_value = [](std::int64_t b, std::int64_t c, std::int64_t f) { return float(1000 * b + 10 * c + f); };
  const std::int64_t chunks[2] = {r, 2 * C - 1 - r};
  std::vector<float> tails(2 * B * F), halos(2 * B * F);
  for (std::int64_t b = 0; b < B; ++b)
    for (int s = 0; s < 2; ++s)
      for (std::int64_t f = 0; f < F; ++f) tails[(b * 2 + s) * F + f] = tail_value(b, chunks[s], f);
  cp.halo(Tensor(tails.data(), {2 * B, F}), Tensor(halos.data(), {2 * B, F}));
  for (std::int64_t b = 0; b < B; ++b)
    for (int s = 0; s < 2; ++s)
      for (std::int64_t f = 0; f < F; ++f)
        EXPECT_EQ(halos[(b * 2 + s) * F + f], chunks[s] == 0 ? 0.f : tail_value(b, chunks[s] - 1, f))
            << "run " << s << " of sequence " << b;
  // <halo(t), dh> summed over ranks == <t, halo_backward(dh)> summed over ranks
  const auto t = random_vector(2 * B * F, 50 + r), dh = random_vector(2 * B * F, 60 + r);
  std::vector<float> h(t.size()), dt(t.size());
  cp.halo(Tensor(const_cast<float*>(t.data()), {2 * B, F}), Tensor(h.data(), {2 * B, F}));
  cp.halo_backward(Tensor(const_cast<float*>(dh.data()), {2 * B, F}), Tensor(dt.data(), {2 * B, F}));
  double lhs = 0, rhs = 0;
  for (std::size_t i = 0; i < t.size(); ++i) lhs += double(h[i]) * dh[i], rhs += double(t[i]) * dt[i];
  MPI_Allreduce(MPI_IN_PLACE, &lhs, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &rhs, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_NEAR(lhs, rhs, 1e-9 * (std::fabs(lhs) + 1));
}

// CCA: the whole-sequence op on every rank, and the split op on this rank's rows.
struct Cca {
  ops::cca::Config c;
  std::int64_t B = 2, S, H = 16, C;
  ops::rope::Table rt;
  std::vector<std::vector<float>> p;
  explicit Cca(std::int64_t seq, int W0) : S(seq) {
    c.hidden = H, c.q_heads = 4, c.kv_heads = 2, c.head_dim = 8, c.conv0_width = W0, c.conv1_width = 2;
    C = c.qk_channels();
    rt = ops::rope::make_table(8, 0.5, 10000.0, 256);
    const float sh = 1.f / std::sqrt(float(H));
    p = {random_vector(C * H, 700, sh), random_vector(16 * H, 701, sh), random_vector(C * W0, 702, 0.8f),
         random_vector(C, 703, 0.3f),   random_vector(C * 8 * 2, 704, 0.3f), random_vector(C, 705, 0.3f),
         random_vector(2, 706, 0.5f),   random_vector(H * 32, 707, 0.2f)};
    for (auto& t : p[6]) t = 1.f + t;
  }
  ops::cca::Params view(std::vector<std::vector<float>>& v) const {
    ops::cca::Params q;
    q.w_qk = Tensor(v[0].data(), {C, H});
    q.w_v = Tensor(v[1].data(), {16, H});
    q.conv0_w = Tensor(v[2].data(), {C, c.conv0_width});
    q.conv0_b = Tensor(v[3].data(), {C});
    q.conv1_w = Tensor(v[4].data(), {C, 8, 2});
    q.conv1_b = Tensor(v[5].data(), {C});
    q.temp = Tensor(v[6].data(), {2});
    q.w_o = Tensor(v[7].data(), {H, 32});
    return q;
  }
  // y [B*T, H] (and with dy: dx, gradients) for rows at positions pos of each sequence (T =
  // pos.size()), through `split` (null: whole sequences, pos 0..S-1).
  void run(const std::vector<float>& x, const std::vector<std::int32_t>& pos, ops::SequenceSplit* split,
           std::vector<float>& y, const std::vector<float>* dy = nullptr, std::vector<float>* dx = nullptr,
           std::vector<std::vector<float>>* g = nullptr) {
    const std::int64_t T = static_cast<std::int64_t>(pos.size()), N = B * T;
    const int segs = split ? split->segments() : 0;
    std::vector<float> saved(ops::cca::saved_floats(c, B, T, segs));
    const ops::cca::Saved s = ops::cca::carve_saved(c, B, T, saved.data(), segs);
    std::vector<std::int32_t> rows;
    for (std::int64_t b = 0; b < B; ++b) rows.insert(rows.end(), pos.begin(), pos.end());
    y.assign(N * H, 0.f);
    auto pp = p;
    ops::cca::forward(c, B, T, Tensor(const_cast<float*>(x.data()), {N, H}), rows.data(), rt, view(pp), s,
                      Tensor(y.data(), {N, H}), split);
    if (!dy) return;
    g->clear();
    for (auto& v : p) g->emplace_back(v.size(), 0.f);
    dx->assign(N * H, 0.f);
    std::vector<float> scratch(ops::cca::backward_scratch_floats(c, B, T, segs));
    ops::cca::backward(c, B, T, Tensor(const_cast<float*>(x.data()), {N, H}), rows.data(), rt, view(pp), s,
                       Tensor(const_cast<float*>(dy->data()), {N, H}), Tensor(dx->data(), {N, H}), view(*g),
                       Tensor(scratch.data(), {static_cast<std::int64_t>(scratch.size())}), split);
  }
};

std::vector<std::int32_t> iota(std::int64_t n) {
  std::vector<std::int32_t> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(static_cast<std::int32_t>(i));
  return v;
}

TEST(ContextParallelCore, CcaMatchesWholeSequences) {
  const int C = world_size();
  for (int W0 : {2, 3}) {
    const std::int64_t S = 2 * C * 4;
    Cca m(S, W0);
    ContextParallel cp(MPI_COMM_WORLD, S);
    const auto& pos = cp.positions();
    const auto x = random_vector(m.B * S * m.H, 900 + W0), dy = random_vector(m.B * S * m.H, 901 + W0);
    std::vector<float> y, dx, ly, ldx;
    std::vector<std::vector<float>> g, lg;
    m.run(x, iota(S), nullptr, y, &dy, &dx, &g);
    const auto lx = local_rows(x, m.B, S, m.H, pos), ldy = local_rows(dy, m.B, S, m.H, pos);
    m.run(lx, pos, &cp, ly, &ldy, &ldx, &lg);
    EXPECT_LT(max_diff(ly, local_rows(y, m.B, S, m.H, pos)), 1e-5) << W0;
    EXPECT_LT(max_diff(ldx, local_rows(dx, m.B, S, m.H, pos)), 1e-5) << W0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      MPI_Allreduce(MPI_IN_PLACE, lg[i].data(), static_cast<int>(lg[i].size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double scale = 0;
      for (float v : g[i]) scale = std::max(scale, double(std::fabs(v)));
      EXPECT_LT(max_diff(lg[i], g[i]), 1e-5 * (scale + 1)) << "W0 " << W0 << " parameter " << i;
    }
  }
}

TEST(ContextParallelCore, CcaIsCausalAcrossRankBoundaries) {
  const int C = world_size(), r = world_rank();
  const std::int64_t S = 2 * C * 3;
  Cca m(S, 2);
  ContextParallel cp(MPI_COMM_WORLD, S);
  const auto& pos = cp.positions();
  const auto x = random_vector(m.B * S * m.H, 990);
  std::vector<float> y0;
  m.run(local_rows(x, m.B, S, m.H, pos), pos, &cp, y0);
  // the first token of every chunk (a rank boundary in the sequence), in sequence 1 only
  for (std::int64_t chunk = 1; chunk < 2 * C; ++chunk) {
    const std::int64_t p0 = chunk * (S / (2 * C));
    auto xp = x;
    for (std::int64_t h = 0; h < m.H; ++h) xp[(1 * S + p0) * m.H + h] += 0.5f;
    std::vector<float> y1;
    m.run(local_rows(xp, m.B, S, m.H, pos), pos, &cp, y1);
    const std::int64_t T = static_cast<std::int64_t>(pos.size());
    int earlier_changed = 0, later_changed = 0;
    for (std::int64_t b = 0; b < m.B; ++b)
      for (std::int64_t t = 0; t < T; ++t) {
        bool changed = false;
        for (std::int64_t h = 0; h < m.H; ++h) changed |= y0[(b * T + t) * m.H + h] != y1[(b * T + t) * m.H + h];
        if (changed && (b == 0 || pos[t] < p0)) ++earlier_changed;
        if (changed && b == 1 && pos[t] >= p0) ++later_changed;
      }
    EXPECT_EQ(earlier_changed, 0) << "rank " << r << ": perturbing position " << p0 << " changed an earlier output";
    MPI_Allreduce(MPI_IN_PLACE, &later_changed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    EXPECT_EQ(later_changed, S - p0) << "position " << p0 << " reaches every later token";
  }
}

// Linear attention over whole sequences (runs = B) and over this rank's zigzag runs (runs = 2B).
struct Linear {
  std::int64_t B = 2, S, Hq = 4, Hkv = 2, D = 4;
  ops::linear_attention::Config c;
  Linear(std::int64_t seq, int chunk, bool decay, std::int64_t kv_heads = 2) : S(seq), Hq(2 * kv_heads), Hkv(kv_heads) {
    c.heads = int(Hq), c.kv_heads = int(Hkv), c.head_dim = int(D), c.chunk = chunk;
    if (decay)
      for (std::int64_t g = 0; g < Hkv; ++g) c.decay.push_back(0.9f - 0.2f * float(g) / float(Hkv));
  }
  // out (and with dout: dq, dk, dv) of the rows q, k, v hold ([B * T, H * D], T tokens each).
  // begin: the exchanges begun first (begin_linear, begin_linear_backward), as the blocks do.
  void run(ContextParallel* cp, std::int64_t T, std::vector<float> q, std::vector<float> k, std::vector<float> v,
           const std::vector<float>& dout, std::vector<float>& out, std::vector<float>* grads,
           bool begin = false) const {
    const std::int64_t N = B * T, runs = cp ? 2 * B : B;
    const Tensor tq(q.data(), {N, Hq * D}), tk(k.data(), {N, Hkv * D}), tv(v.data(), {N, Hkv * D});
    out.assign(q.size(), 0.f);
    std::vector<float> init(cp ? std::size_t(runs * Hkv * D * D) : 0);
    const Tensor tinit = cp ? Tensor(init.data(), {runs, Hkv, D, D}) : Tensor();
    ops::SequenceSplit& split = cp ? static_cast<ops::SequenceSplit&>(*cp) : ops::whole_sequences();
    if (begin) split.begin_linear(c, runs, tk, tv);
    split.attend_linear(c, runs, tq, tk, tv, tinit, Tensor(out.data(), {N, Hq * D}));
    if (!grads) return;
    std::vector<float> dq(q.size()), dk(k.size()), dv(v.size()), d = dout;
    if (begin) split.begin_linear_backward(c, runs, tq, Tensor(d.data(), {N, Hq * D}));
    split.attend_linear_backward(c, runs, tq, tk, tv, tinit, Tensor(d.data(), {N, Hq * D}),
                                 Tensor(dq.data(), {N, Hq * D}), Tensor(dk.data(), {N, Hkv * D}),
                                 Tensor(dv.data(), {N, Hkv * D}));
    grads[0] = dq, grads[1] = dk, grads[2] = dv;
  }
};

void expect_linear_matches_whole_sequences(ContextMode mode, bool begin = false) {
  const int C = world_size();
  const std::int64_t S = 2 * C * 5, kv_heads = mode == ContextMode::kAllToAll ? 2 * C : 2;
  ContextParallel cp(MPI_COMM_WORLD, S, mode);
  const auto& pos = cp.positions();
  const std::int64_t T = S / C;
  for (const bool decay : {false, true})
    for (const int chunk : {2, 5, 64}) {
      const Linear m(S, chunk, decay, kv_heads);
      const std::uint32_t seed = 700 + chunk + (decay ? 50 : 0);
      const auto q = random_vector(m.B * S * m.Hq * m.D, seed, 0.5f), k = random_vector(m.B * S * m.Hkv * m.D, seed + 1, 0.5f),
                 v = random_vector(m.B * S * m.Hkv * m.D, seed + 2), dout = random_vector(m.B * S * m.Hq * m.D, seed + 3);
      std::vector<float> out, lout;
      std::vector<float> g[3], lg[3];
      m.run(nullptr, S, q, k, v, dout, out, g);
      m.run(&cp, T, local_rows(q, m.B, S, m.Hq * m.D, pos), local_rows(k, m.B, S, m.Hkv * m.D, pos),
            local_rows(v, m.B, S, m.Hkv * m.D, pos), local_rows(dout, m.B, S, m.Hq * m.D, pos), lout, lg, begin);
      const std::string tag = fmt::format("decay {} chunk {}{}", decay, chunk, begin ? " begun" : "");
      EXPECT_LT(max_diff(lout, local_rows(out, m.B, S, m.Hq * m.D, pos)), 1e-5) << tag;
      EXPECT_LT(max_diff(lg[0], local_rows(g[0], m.B, S, m.Hq * m.D, pos)), 1e-5) << tag;
      EXPECT_LT(max_diff(lg[1], local_rows(g[1], m.B, S, m.Hkv * m.D, pos)), 1e-5) << tag;
      EXPECT_LT(max_diff(lg[2], local_rows(g[2], m.B, S, m.Hkv * m.D, pos)), 1e-5) << tag;
    }
}

TEST(ContextParallelCore, Lasp2MatchesWholeSequences) { expect_linear_matches_whole_sequences(ContextMode::kAllGather); }
// The ring mode's linear layers: LASP-1, the states passed rank to rank in sequence order.
// The blocks' order: each all-gather begun (MPI_Iallgather) before the work that overlaps it,
// finished by the attend call; the other modes take the begin calls as nothing.
TEST(ContextParallelCore, Lasp2BegunEarlyMatchesWholeSequences) {
  expect_linear_matches_whole_sequences(ContextMode::kAllGather, true);
  expect_linear_matches_whole_sequences(ContextMode::kRing, true);
}

// A begin not followed by its attend call (another begin, or the other direction's attend) is
// a programming error, named; the core is usable after the pair completes.
TEST(ContextParallelCore, Lasp2BeginsPairWithTheirAttendCalls) {
  const int C = world_size();
  const std::int64_t S = 2 * C * 4, T = S / C;
  ContextParallel cp(MPI_COMM_WORLD, S);
  const Linear m(S, 4, true);
  const std::int64_t runs = 2 * m.B, N = m.B * T;
  auto q = random_vector(N * m.Hq * m.D, 81, 0.5f), k = random_vector(N * m.Hkv * m.D, 82, 0.5f),
       v = random_vector(N * m.Hkv * m.D, 83), d = random_vector(N * m.Hq * m.D, 84), out = q, dq = q, dk = k, dv = v;
  std::vector<float> init(std::size_t(runs * m.Hkv * m.D * m.D));
  const Tensor tq(q.data(), {N, m.Hq * m.D}), tk(k.data(), {N, m.Hkv * m.D}), tv(v.data(), {N, m.Hkv * m.D}),
      td(d.data(), {N, m.Hq * m.D}), tinit(init.data(), {runs, m.Hkv, m.D, m.D}), tout(out.data(), {N, m.Hq * m.D});
  cp.begin_linear(m.c, runs, tk, tv);
  EXPECT_THROW(cp.begin_linear(m.c, runs, tk, tv), Error);
  EXPECT_THROW(cp.attend_linear_backward(m.c, runs, tq, tk, tv, tinit, td, Tensor(dq.data(), {N, m.Hq * m.D}),
                                         Tensor(dk.data(), {N, m.Hkv * m.D}), Tensor(dv.data(), {N, m.Hkv * m.D})),
               Error);
  cp.attend_linear(m.c, runs, tq, tk, tv, tinit, tout);
  cp.begin_linear_backward(m.c, runs, tq, td);
  EXPECT_THROW(cp.attend_linear(m.c, runs, tq, tk, tv, tinit, tout), Error);
  cp.attend_linear_backward(m.c, runs, tq, tk, tv, tinit, td, Tensor(dq.data(), {N, m.Hq * m.D}),
                            Tensor(dk.data(), {N, m.Hkv * m.D}), Tensor(dv.data(), {N, m.Hkv * m.D}));
  cp.attend_linear(m.c, runs, tq, tk, tv, tinit, tout);  // nothing begun: the whole exchange here
}

TEST(ContextParallelCore, Lasp1RingMatchesWholeSequences) { expect_linear_matches_whole_sequences(ContextMode::kRing); }
// By heads: whole sequences of 1/C of the heads (and their decays) from a zero state.
TEST(ContextParallelCore, AllToAllLinearMatchesWholeSequences) {
  expect_linear_matches_whole_sequences(ContextMode::kAllToAll);
}

// Perturbing the k and v of any position p (every position: inside chunks, at chunk and rank
// boundaries, in both zigzag runs) changes no output before p on any rank, and every one from p on.
TEST(ContextParallelCore, Lasp2IsCausalAtEveryPosition) {
  const int C = world_size(), r = world_rank();
  const std::int64_t S = 2 * C * 3;
  ContextParallel cp(MPI_COMM_WORLD, S);
  const auto& pos = cp.positions();
  const std::int64_t T = S / C;
  const Linear m(S, 2, /*decay=*/true);
  const auto q = random_vector(m.B * S * m.Hq * m.D, 800, 0.5f), k = random_vector(m.B * S * m.Hkv * m.D, 801, 0.5f),
             v = random_vector(m.B * S * m.Hkv * m.D, 802);
  const auto lq = local_rows(q, m.B, S, m.Hq * m.D, pos);
  std::vector<float> y0;
  m.run(&cp, T, lq, local_rows(k, m.B, S, m.Hkv * m.D, pos), local_rows(v, m.B, S, m.Hkv * m.D, pos), {}, y0, nullptr);
  const std::int64_t W = m.Hq * m.D;
  for (std::int64_t p0 = 0; p0 < S; ++p0) {
    auto kp = k, vp = v;
    for (std::int64_t j = 0; j < m.Hkv * m.D; ++j) kp[(1 * S + p0) * m.Hkv * m.D + j] += 0.5f, vp[(1 * S + p0) * m.Hkv * m.D + j] -= 0.5f;
    std::vector<float> y1;
    m.run(&cp, T, lq, local_rows(kp, m.B, S, m.Hkv * m.D, pos), local_rows(vp, m.B, S, m.Hkv * m.D, pos), {}, y1,
          nullptr);
    int earlier_changed = 0, later_changed = 0;
    for (std::int64_t b = 0; b < m.B; ++b)
      for (std::int64_t t = 0; t < T; ++t) {
        bool changed = false;
        for (std::int64_t h = 0; h < W; ++h) changed |= y0[(b * T + t) * W + h] != y1[(b * T + t) * W + h];
        if (changed && (b == 0 || pos[t] < p0)) ++earlier_changed;
        if (changed && b == 1 && pos[t] >= p0) ++later_changed;
      }
    EXPECT_EQ(earlier_changed, 0) << "rank " << r << ": perturbing position " << p0 << " changed an earlier output";
    MPI_Allreduce(MPI_IN_PLACE, &later_changed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    EXPECT_EQ(later_changed, S - p0) << "position " << p0 << " reaches every later token";
  }
}

}  // namespace
}  // namespace keel::parallel

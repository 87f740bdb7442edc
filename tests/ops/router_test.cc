#include "ops/router.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/error.h"
#include "gradcheck.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
namespace rt = ops::router;

struct RouterCase {
  std::int64_t n, e;
  rt::Options o;
  std::vector<float> logits, bias, probs, lse, gates;
  std::vector<std::int32_t> idx;
  std::vector<std::int64_t> counts;
  RouterCase(std::int64_t n_, std::int64_t e_, int k, bool renorm) : n(n_), e(e_) {
    o.top_k = k;
    o.renormalize = renorm;
    // Well-separated logits (a shuffled ladder, step 0.6, plus small noise) so +-1e-3
    // perturbations never change the selection.
    std::mt19937 rng(90);
    std::uniform_real_distribution<float> noise(-0.1f, 0.1f);
    logits.resize(n * e);
    for (std::int64_t i = 0; i < n; ++i) {
      std::vector<int> perm(e);
      for (int j = 0; j < e; ++j) perm[j] = j;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < e; ++j) logits[i * e + j] = 0.6f * perm[j] - 1.2f + noise(rng);
    }
    probs.resize(n * e);
    lse.resize(n);
    gates.resize(n * k);
    idx.resize(n * k);
    counts.resize(e);
  }
  rt::Losses forward() {
    return rt::forward(Tensor(logits.data(), {n, e}), bias.empty() ? Tensor() : Tensor(bias.data(), {e}), o,
                       Tensor(probs.data(), {n, e}), Tensor(lse.data(), {n}), idx.data(), Tensor(gates.data(), {n, o.top_k}),
                       counts.data());
  }
};

TEST(OpRouter, GradCheckGatesAuxAndZLoss) {
  for (bool renorm : {false, true}) {
    RouterCase c(8, 6, 2, renorm);
    c.bias = {0.01f, -0.02f, 0.f, 0.03f, 0.f, -0.01f};
    auto rg = random_vector(c.n * 2, 91);
    const float d_aux = 0.3f, d_z = 0.2f;
    c.forward();
    const auto idx0 = c.idx;
    bool selection_stable = true;
    auto loss = [&] {
      rt::Losses l = c.forward();
      selection_stable &= c.idx == idx0;
      return test::weighted_sum(c.gates.data(), rg) + d_aux * double(l.aux) + d_z * double(l.z);
    };
    loss();
    std::vector<float> dlogits(c.n * c.e);
    rt::backward(Tensor(c.probs.data(), {c.n, c.e}), Tensor(c.lse.data(), {c.n}), c.idx.data(), Tensor(c.gates.data(), {c.n, 2}),
                 c.counts.data(), c.o, Tensor(rg.data(), {c.n, 2}), d_aux, d_z, Tensor(dlogits.data(), {c.n, c.e}));
    const std::string tag = renorm ? " (top-2, renormalized)" : " (top-2)";
    EXPECT_LT(check_grad("router dlogits" + tag, loss, c.logits.data(), dlogits.data(), c.logits.size()).rel_err, kGradTol);
    EXPECT_TRUE(selection_stable);
    // The balancing bias only selects: nudging it (without changing the choice) leaves the
    // loss bit-for-bit unchanged, so its finite-difference gradient is exactly zero.
    const double base = loss();
    for (std::size_t j = 0; j < c.bias.size(); ++j) {
      const float b0 = c.bias[j];
      c.bias[j] = b0 + 1e-3f;
      EXPECT_EQ(loss(), base) << "bias " << j;
      c.bias[j] = b0;
    }
    EXPECT_TRUE(selection_stable);
    // Each loss term alone, so a wrong term cannot hide behind the others.
    for (int term = 0; term < 3; ++term) {
      std::vector<float> zero(c.n * 2, 0.f);
      const float a = term == 1 ? d_aux : 0.f, z = term == 2 ? d_z : 0.f;
      auto l1 = [&] {
        rt::Losses l = c.forward();
        return (term == 0 ? test::weighted_sum(c.gates.data(), rg) : 0.0) + a * double(l.aux) + z * double(l.z);
      };
      l1();
      rt::backward(Tensor(c.probs.data(), {c.n, c.e}), Tensor(c.lse.data(), {c.n}), c.idx.data(), Tensor(c.gates.data(), {c.n, 2}),
                   c.counts.data(), c.o, Tensor(term == 0 ? rg.data() : zero.data(), {c.n, 2}), a, z,
                   Tensor(dlogits.data(), {c.n, c.e}));
      const char* names[] = {"gates", "aux", "z"};
      EXPECT_LT(check_grad(std::string("router dlogits, ") + names[term] + " only" + tag, l1, c.logits.data(), dlogits.data(),
                           c.logits.size())
                    .rel_err,
                kGradTol);
    }
  }
}

TEST(OpRouter, BiasChangesSelectionButNotGates) {
  RouterCase c(1, 4, 1, false);
  c.logits = {2.f, 1.f, 0.f, -1.f};
  c.forward();
  EXPECT_EQ(c.idx[0], 0);
  const auto probs0 = c.probs;
  c.bias = {0.f, 0.f, 0.f, 1.f};  // lifts the least likely expert above the best
  c.forward();
  EXPECT_EQ(c.idx[0], 3);
  EXPECT_EQ(c.probs, probs0);  // probabilities ignore the bias
  EXPECT_FLOAT_EQ(c.gates[0], probs0[3]);  // the gate is the unbiased probability
  EXPECT_EQ(c.counts, (std::vector<std::int64_t>{0, 0, 0, 1}));
}

TEST(OpRouter, LossesAndCountsMatchNaive) {
  RouterCase c(300, 5, 2, false);  // enough rows for the threaded row loop
  rt::Losses l = c.forward();
  std::vector<double> f(c.e, 0), pm(c.e, 0);
  double z = 0;
  for (std::int64_t i = 0; i < c.n; ++i) {
    double m = -1e300, s = 0;
    for (int j = 0; j < c.e; ++j) m = std::max(m, double(c.logits[i * c.e + j]));
    for (int j = 0; j < c.e; ++j) s += std::exp(c.logits[i * c.e + j] - m);
    const double lz = m + std::log(s);
    z += lz * lz / c.n;
    std::vector<std::pair<double, int>> order;
    for (int j = 0; j < c.e; ++j) {
      const double p = std::exp(c.logits[i * c.e + j] - lz);
      pm[j] += p / c.n;
      order.push_back({-p, j});
    }
    std::sort(order.begin(), order.end());
    for (int k = 0; k < 2; ++k) {
      EXPECT_EQ(c.idx[i * 2 + k], order[k].second);
      EXPECT_NEAR(c.gates[i * 2 + k], -order[k].first, 1e-6);
      f[order[k].second] += 1.0 / (c.n * 2);
    }
  }
  double aux = 0;
  for (int j = 0; j < c.e; ++j) {
    aux += c.e * f[j] * pm[j];
    EXPECT_EQ(c.counts[j], std::llround(f[j] * c.n * 2));
  }
  EXPECT_NEAR(l.aux, aux, 1e-5);
  EXPECT_NEAR(l.z, z, 1e-5);
}

TEST(OpRouter, UniformRouterTiesGoToLowerIndexAndAuxIsOne) {
  RouterCase c(4, 4, 2, true);
  std::fill(c.logits.begin(), c.logits.end(), 0.5f);
  rt::Losses l = c.forward();
  for (std::int64_t i = 0; i < c.n; ++i) {
    EXPECT_EQ(c.idx[i * 2], 0);
    EXPECT_EQ(c.idx[i * 2 + 1], 1);
    EXPECT_FLOAT_EQ(c.gates[i * 2], 0.5f);  // renormalized over the top 2
  }
  EXPECT_NEAR(l.aux, 1.0, 1e-6);  // P uniform: E * sum f_e / E = 1 whatever f is
  EXPECT_NEAR(l.z, std::pow(0.5 + std::log(4.0), 2), 1e-5);
}

// Forced balance (benchmarking): slot j of token n takes class (n * top_k + j) mod F whatever
// the scores and the bias; gates are the chosen classes' probabilities; with N * top_k a
// multiple of F each of the F classes gets exactly N * top_k / F slots, the others none.
TEST(OpRouter, ForcedBalanceSelectsBySlotAndBalancesExactly) {
  for (bool renorm : {false, true}) {
    for (int forced : {6, 4}) {  // all experts, and the first 4 of 6 (as ZAYA1's experts without skip)
      SCOPED_TRACE(testing::Message() << "forced " << forced << (renorm ? " renormalized" : ""));
      RouterCase c(12, 6, 2, renorm);
      c.bias = {0.f, 0.f, 0.f, 0.f, 0.f, 5.f};  // would win every token without forcing
      c.forward();
      const auto natural = c.idx;
      const auto probs0 = c.probs;
      c.o.forced_classes = forced;
      const rt::Losses l = c.forward();
      EXPECT_EQ(c.probs, probs0);  // the probabilities do not depend on the selection
      EXPECT_NE(c.idx, natural);
      for (std::int64_t i = 0; i < c.n; ++i) {
        const float* p = c.probs.data() + i * c.e;
        const int a = c.idx[i * 2], b = c.idx[i * 2 + 1];
        EXPECT_EQ(a, (i * 2) % forced) << "token " << i;
        EXPECT_EQ(b, (i * 2 + 1) % forced) << "token " << i;
        const float norm = renorm ? p[a] + p[b] : 1.f;
        EXPECT_FLOAT_EQ(c.gates[i * 2], p[a] / norm) << "token " << i;
        EXPECT_FLOAT_EQ(c.gates[i * 2 + 1], p[b] / norm) << "token " << i;
      }
      for (int j = 0; j < c.e; ++j) EXPECT_EQ(c.counts[j], j < forced ? 12 * 2 / forced : 0) << "expert " << j;
      // The aux loss is the normal one on the forced counts: E * sum_e (1/F) P_e over e < F.
      double aux = 0;
      for (int j = 0; j < forced; ++j) {
        double pm = 0;
        for (std::int64_t i = 0; i < c.n; ++i) pm += c.probs[i * c.e + j] / double(c.n);
        aux += double(c.e) / forced * pm;
      }
      EXPECT_NEAR(l.aux, aux, 1e-5);
    }
  }
  // Fewer forced classes than top_k cannot give distinct classes per token; more than E is out of range.
  for (int forced : {1, 7, -1}) {
    RouterCase c(4, 6, 2, false);
    c.o.forced_classes = forced;
    EXPECT_THROW(c.forward(), Error) << "forced " << forced;
  }
}

// Backward under forced selection: the normal gradient of the forced gates, aux and z losses.
TEST(OpRouter, GradCheckForcedBalance) {
  for (bool renorm : {false, true}) {
    RouterCase c(8, 6, 2, renorm);
    c.o.forced_classes = 5;
    c.bias = {0.01f, -0.02f, 0.f, 0.03f, 0.f, -0.01f};
    auto rg = random_vector(c.n * 2, 92);
    const float d_aux = 0.3f, d_z = 0.2f;
    auto loss = [&] {
      rt::Losses l = c.forward();
      return test::weighted_sum(c.gates.data(), rg) + d_aux * double(l.aux) + d_z * double(l.z);
    };
    loss();
    std::vector<float> dlogits(c.n * c.e);
    rt::backward(Tensor(c.probs.data(), {c.n, c.e}), Tensor(c.lse.data(), {c.n}), c.idx.data(), Tensor(c.gates.data(), {c.n, 2}),
                 c.counts.data(), c.o, Tensor(rg.data(), {c.n, 2}), d_aux, d_z, Tensor(dlogits.data(), {c.n, c.e}));
    const std::string tag = renorm ? " (forced, top-2, renormalized)" : " (forced, top-2)";
    EXPECT_LT(check_grad("router dlogits" + tag, loss, c.logits.data(), dlogits.data(), c.logits.size()).rel_err, kGradTol);
    // The bias is ignored entirely: even a large change leaves the loss bit-for-bit unchanged.
    const double base = loss();
    c.bias[4] = 3.f;
    EXPECT_EQ(loss(), base);
  }
}

}  // namespace
}  // namespace keel

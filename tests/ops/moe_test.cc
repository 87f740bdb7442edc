#include "ops/moe.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/error.h"
#include "gradcheck.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
namespace moe = ops::moe;

TEST(OpMoe, PlanIsAStableCountingSortWithEmptyExperts) {
  // 5 tokens, top-2, 4 experts; expert 2 receives nothing.
  std::vector<std::int32_t> idx = {1, 0, 3, 1, 0, 3, 1, 3, 0, 1};
  moe::Plan p = moe::make_plan(idx.data(), 5, 2, 4);
  EXPECT_EQ(p.counts, (std::vector<std::int64_t>{3, 4, 0, 3}));
  EXPECT_EQ(p.offsets, (std::vector<std::int64_t>{0, 3, 7, 7, 10}));
  // Expert 0's block lists its assignments in token order: a = 1, 4, 8.
  EXPECT_EQ(p.source[0], 1);
  EXPECT_EQ(p.source[1], 4);
  EXPECT_EQ(p.source[2], 8);
  for (std::int64_t a = 0; a < 10; ++a) {
    EXPECT_EQ(p.source[p.position[a]], a);
    const std::int64_t slot = p.position[a];
    EXPECT_TRUE(slot >= p.offsets[idx[a]] && slot < p.offsets[idx[a] + 1]);
  }
  std::vector<std::int32_t> bad = {0, 4};
  EXPECT_THROW(moe::make_plan(bad.data(), 1, 2, 4), Error);
}

struct MoeCase {
  std::int64_t n = 6, d = 5, f = 7;
  int k = 2, e = 4;
  std::vector<std::int32_t> idx = {0, 1, 1, 3, 3, 0, 1, 0, 3, 1, 0, 3};  // expert 2 gets no tokens
  moe::Plan plan = moe::make_plan(idx.data(), n, k, e);
  std::int64_t s = n * k;
  std::vector<float> x = random_vector(n * d, 100), gates = random_vector(n * k, 101), wg = random_vector(e * f * d, 102, 0.5f),
                     wu = random_vector(e * f * d, 103, 0.5f), wd = random_vector(e * d * f, 104, 0.5f);
  std::vector<float> xs = std::vector<float>(s * d), hg = std::vector<float>(s * f), hu = hg, act = hg, ys = xs,
                     y = std::vector<float>(n * d);
  moe::Weights weights() {
    return {Tensor(wg.data(), {e, f, d}), Tensor(wu.data(), {e, f, d}), Tensor(wd.data(), {e, d, f})};
  }
  moe::Saved saved() {
    return {Tensor(xs.data(), {s, d}), Tensor(hg.data(), {s, f}), Tensor(hu.data(), {s, f}), Tensor(act.data(), {s, f}),
            Tensor(ys.data(), {s, d})};
  }
  void forward() { moe::forward(plan, Tensor(x.data(), {n, d}), Tensor(gates.data(), {n, k}), weights(), saved(), Tensor(y.data(), {n, d})); }
};

// y[n] = sum_k gate * W_down (silu(W_gate x) * (W_up x)), token by token in double.
void expect_matches_naive(const MoeCase& c) {
  for (std::int64_t i = 0; i < c.n; ++i) {
    std::vector<double> out(c.d, 0.0);
    for (int kk = 0; kk < c.k; ++kk) {
      const int ex = c.idx[i * c.k + kk];
      std::vector<double> a(c.f);
      for (std::int64_t j = 0; j < c.f; ++j) {
        double g = 0, u = 0;
        for (std::int64_t x = 0; x < c.d; ++x) {
          g += double(c.wg[(ex * c.f + j) * c.d + x]) * c.x[i * c.d + x];
          u += double(c.wu[(ex * c.f + j) * c.d + x]) * c.x[i * c.d + x];
        }
        a[j] = g / (1 + std::exp(-g)) * u;
      }
      for (std::int64_t x = 0; x < c.d; ++x) {
        double o = 0;
        for (std::int64_t j = 0; j < c.f; ++j) o += double(c.wd[(ex * c.d + x) * c.f + j]) * a[j];
        out[x] += c.gates[i * c.k + kk] * o;
      }
    }
    for (std::int64_t x = 0; x < c.d; ++x) ASSERT_NEAR(c.y[i * c.d + x], out[x], 1e-5) << "token " << i;
  }
}

TEST(OpMoe, ForwardMatchesNaivePerTokenExperts) {
  MoeCase c;
  c.forward();
  expect_matches_naive(c);
}

// Enough tokens for the threaded gather/combine loops, top-3 of 5 experts, one expert idle.
TEST(OpMoe, LargerBatchMatchesNaive) {
  MoeCase c;
  c.n = 200;
  c.k = 3;
  c.e = 5;
  c.s = c.n * c.k;
  c.idx.resize(c.s);
  for (std::int64_t i = 0; i < c.n; ++i)
    for (int kk = 0; kk < c.k; ++kk) c.idx[i * c.k + kk] = std::int32_t((i + kk) % 4 + ((i + kk) % 4 >= 2));  // never 2
  c.plan = moe::make_plan(c.idx.data(), c.n, c.k, c.e);
  EXPECT_EQ(c.plan.counts[2], 0);
  c.x = random_vector(c.n * c.d, 106);
  c.gates = random_vector(c.n * c.k, 107);
  c.wg = random_vector(c.e * c.f * c.d, 108, 0.5f);
  c.wu = random_vector(c.e * c.f * c.d, 109, 0.5f);
  c.wd = random_vector(c.e * c.d * c.f, 110, 0.5f);
  c.xs.assign(c.s * c.d, 0.f);
  c.ys = c.xs;
  c.hg.assign(c.s * c.f, 0.f);
  c.hu = c.act = c.hg;
  c.y.assign(c.n * c.d, 0.f);
  c.forward();
  expect_matches_naive(c);
}

TEST(OpMoe, GradCheckInputsGatesAndExpertWeights) {
  MoeCase c;
  auto r = random_vector(c.n * c.d, 105);
  auto loss = [&] {
    c.forward();
    return test::weighted_sum(c.y.data(), r);
  };
  loss();
  std::vector<float> dx(c.x.size()), dgates(c.gates.size()), dwg(c.wg.size(), 0.f), dwu(c.wu.size(), 0.f), dwd(c.wd.size(), 0.f);
  std::vector<float> scratch(moe::backward_scratch_floats(c.s, c.d, c.f));
  moe::backward(c.plan, Tensor(c.x.data(), {c.n, c.d}), Tensor(c.gates.data(), {c.n, c.k}), c.weights(), c.saved(),
                Tensor(r.data(), {c.n, c.d}), Tensor(scratch.data(), {std::int64_t(scratch.size())}),
                Tensor(dx.data(), {c.n, c.d}), Tensor(dgates.data(), {c.n, c.k}),
                {Tensor(dwg.data(), {c.e, c.f, c.d}), Tensor(dwu.data(), {c.e, c.f, c.d}), Tensor(dwd.data(), {c.e, c.d, c.f})});
  // The expert without tokens gets exactly zero gradient.
  for (std::int64_t j = 0; j < c.f * c.d; ++j) {
    EXPECT_EQ(dwg[2 * c.f * c.d + j], 0.f);
    EXPECT_EQ(dwu[2 * c.f * c.d + j], 0.f);
    EXPECT_EQ(dwd[2 * c.d * c.f + j], 0.f);
  }
  EXPECT_LT(check_grad("moe dx", loss, c.x.data(), dx.data(), c.x.size()).rel_err, kGradTol);
  EXPECT_LT(check_grad("moe dgates", loss, c.gates.data(), dgates.data(), c.gates.size()).rel_err, kGradTol);
  EXPECT_LT(check_grad("moe dW_gate", loss, c.wg.data(), dwg.data(), c.wg.size()).rel_err, kGradTol);
  EXPECT_LT(check_grad("moe dW_up", loss, c.wu.data(), dwu.data(), c.wu.size()).rel_err, kGradTol);
  EXPECT_LT(check_grad("moe dW_down", loss, c.wd.data(), dwd.data(), c.wd.size()).rel_err, kGradTol);
}

TEST(OpMoe, RejectsShortScratch) {
  MoeCase c;
  c.forward();
  std::vector<float> scratch(10), dx(c.x.size());
  EXPECT_THROW(moe::backward(c.plan, Tensor(c.x.data(), {c.n, c.d}), Tensor(c.gates.data(), {c.n, c.k}), c.weights(), c.saved(),
                             Tensor(c.y.data(), {c.n, c.d}), Tensor(scratch.data(), {10}), Tensor(dx.data(), {c.n, c.d}), Tensor(),
                             moe::Weights{}),
               Error);
}

}  // namespace
}  // namespace keel

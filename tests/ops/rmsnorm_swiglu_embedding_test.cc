#include <gtest/gtest.h>

#include <cmath>

#include "common/error.h"
#include "gradcheck.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
using test::weighted_sum;

TEST(OpRmsNorm, ForwardMatchesNaive) {
  const std::int64_t n = 4, d = 9;
  auto x = random_vector(n * d, 10), w = random_vector(d, 11);
  std::vector<float> y(n * d), rstd(n);
  ops::rmsnorm::forward(Tensor(x.data(), {n, d}), Tensor(w.data(), {d}), 1e-5f, Tensor(y.data(), {n, d}),
                        Tensor(rstd.data(), {n}));
  for (std::int64_t i = 0; i < n; ++i) {
    double ms = 0;
    for (std::int64_t j = 0; j < d; ++j) ms += double(x[i * d + j]) * x[i * d + j] / d;
    double r = 1 / std::sqrt(ms + 1e-5);
    EXPECT_NEAR(rstd[i], r, 1e-5 * r);
    for (std::int64_t j = 0; j < d; ++j) EXPECT_NEAR(y[i * d + j], x[i * d + j] * r * w[j], 1e-5);
  }
}

// Enough rows that parallel_for splits the work across threads (each thread owns rows for dx
// and channels for dw), against the same formulas evaluated serially in double.
TEST(OpRmsNorm, ThreadedBackwardMatchesSerialDouble) {
  const std::int64_t n = 512, d = 64;
  auto x = random_vector(n * d, 15), w = random_vector(d, 16), dy = random_vector(n * d, 17);
  std::vector<float> y(n * d), rstd(n), dx(n * d, 0.f), dw(d, 0.f);  // dx starts at 0: rmsnorm adds into it
  Tensor tx(x.data(), {n, d}), tw(w.data(), {d}), tr(rstd.data(), {n});
  ops::rmsnorm::forward(tx, tw, 1e-5f, Tensor(y.data(), {n, d}), tr);
  ops::rmsnorm::backward(tx, tw, tr, Tensor(dy.data(), {n, d}), Tensor(dx.data(), {n, d}), Tensor(dw.data(), {d}));
  std::vector<double> dw_ref(d, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    double ms = 0, dot = 0;
    for (std::int64_t j = 0; j < d; ++j) ms += double(x[i * d + j]) * x[i * d + j] / d;
    const double r = 1 / std::sqrt(ms + 1e-5);
    for (std::int64_t j = 0; j < d; ++j) dot += double(dy[i * d + j]) * w[j] * x[i * d + j] * r / d;
    for (std::int64_t j = 0; j < d; ++j) {
      EXPECT_NEAR(dx[i * d + j], r * (dy[i * d + j] * w[j] - x[i * d + j] * r * dot), 1e-4);
      dw_ref[j] += double(dy[i * d + j]) * x[i * d + j] * r;
    }
  }
  for (std::int64_t j = 0; j < d; ++j) EXPECT_NEAR(dw[j], dw_ref[j], 1e-3);
}

TEST(OpRmsNorm, GradCheck) {
  const std::int64_t n = 6, d = 16;
  auto x = random_vector(n * d, 12), w = random_vector(d, 13), r = random_vector(n * d, 14);
  std::vector<float> y(n * d), rstd(n), dx(n * d, 0.f), dw(d, 0.f);  // dx starts at 0: rmsnorm adds into it
  Tensor tx(x.data(), {n, d}), tw(w.data(), {d}), ty(y.data(), {n, d}), tr(rstd.data(), {n});
  const float eps = 1e-5f;
  auto loss = [&] {
    ops::rmsnorm::forward(tx, tw, eps, ty, tr);
    return weighted_sum(y.data(), r);
  };
  loss();
  ops::rmsnorm::backward(tx, tw, tr, Tensor(r.data(), {n, d}), Tensor(dx.data(), {n, d}), Tensor(dw.data(), {d}));
  EXPECT_LT(check_grad("rmsnorm dx", loss, x.data(), dx.data(), n * d).rel_err, kGradTol);
  EXPECT_LT(check_grad("rmsnorm dw", loss, w.data(), dw.data(), d).rel_err, kGradTol);
}

// Both gradients are accumulated (docs/ops.md, Gradient convention: dx is the residual-stream
// exception). Rows chosen so every value is exact in fp32: x = 1 (rstd 1) and x = 2 (rstd 1/2),
// eps 0, so xhat = 1 and dx = rstd (dy w - mean(dy w)), dw = sum_n dy.
TEST(OpRmsNorm, BackwardAccumulatesIntoDxAndDw) {
  const std::int64_t n = 2, d = 4;
  std::vector<float> x = {1, 1, 1, 1, 2, 2, 2, 2}, w = {2, 1, 1, 0.5f}, dy = {1, 2, 3, 4, 4, 0, -2, 2};
  std::vector<float> y(n * d), rstd(n);
  Tensor tx(x.data(), {n, d}), tw(w.data(), {d}), tr(rstd.data(), {n});
  ops::rmsnorm::forward(tx, tw, 0.f, Tensor(y.data(), {n, d}), tr);
  ASSERT_EQ(rstd, (std::vector<float>{1.f, 0.5f}));
  std::vector<float> dx = {10, 20, 30, 40, -1, 1, -1, 1}, dw = {0.5f, -1, 0.25f, 2};
  ops::rmsnorm::backward(tx, tw, tr, Tensor(dy.data(), {n, d}), Tensor(dx.data(), {n, d}), Tensor(dw.data(), {d}));
  // Row 0: dy w = (2, 2, 3, 2), mean 2.25 -> (-0.25, -0.25, 0.75, -0.25).
  // Row 1: dy w = (8, 0, -2, 1), mean 1.75, rstd 0.5 -> (3.125, -0.875, -1.875, -0.375).
  EXPECT_EQ(dx, (std::vector<float>{9.75f, 19.75f, 30.75f, 39.75f, 2.125f, 0.125f, -2.875f, 0.625f}));
  // dw: (1, 2, 3, 4) + (4, 0, -2, 2) = (5, 2, 1, 6) onto (0.5, -1, 0.25, 2).
  EXPECT_EQ(dw, (std::vector<float>{5.5f, 1.f, 1.25f, 8.f}));

  // Random inputs: from a non-zero start, each element is that start plus the result from a
  // zero start, bit for bit (one fp32 add per element).
  const std::int64_t m = 300, e = 40;
  auto rx = random_vector(m * e, 30), rw = random_vector(e, 31), rdy = random_vector(m * e, 32);
  auto dx0 = random_vector(m * e, 33), dw0 = random_vector(e, 34);
  std::vector<float> ry(m * e), rr(m), fresh_dx(m * e, 0.f), fresh_dw(e, 0.f);
  Tensor rtx(rx.data(), {m, e}), rtw(rw.data(), {e}), rtr(rr.data(), {m});
  ops::rmsnorm::forward(rtx, rtw, 1e-5f, Tensor(ry.data(), {m, e}), rtr);
  ops::rmsnorm::backward(rtx, rtw, rtr, Tensor(rdy.data(), {m, e}), Tensor(fresh_dx.data(), {m, e}),
                         Tensor(fresh_dw.data(), {e}));
  auto acc_dx = dx0, acc_dw = dw0;
  ops::rmsnorm::backward(rtx, rtw, rtr, Tensor(rdy.data(), {m, e}), Tensor(acc_dx.data(), {m, e}),
                         Tensor(acc_dw.data(), {e}));
  for (std::int64_t i = 0; i < m * e; ++i) ASSERT_EQ(acc_dx[i], dx0[i] + fresh_dx[i]) << "dx " << i;
  for (std::int64_t j = 0; j < e; ++j) ASSERT_EQ(acc_dw[j], dw0[j] + fresh_dw[j]) << "dw " << j;
}

TEST(OpSwiglu, ForwardAndGradCheck) {
  const std::int64_t n = 5, f = 12;
  auto g = random_vector(n * f, 20, 3.f), u = random_vector(n * f, 21), r = random_vector(n * f, 22);
  std::vector<float> out(n * f), dg(n * f), du(n * f);
  Tensor tg(g.data(), {n, f}), tu(u.data(), {n, f}), to(out.data(), {n, f});
  auto loss = [&] {
    ops::swiglu::forward(tg, tu, to);
    return weighted_sum(out.data(), r);
  };
  loss();
  for (std::int64_t i = 0; i < n * f; ++i) EXPECT_NEAR(out[i], g[i] / (1 + std::exp(-double(g[i]))) * u[i], 1e-5);
  ops::swiglu::backward(tg, tu, Tensor(r.data(), {n, f}), Tensor(dg.data(), {n, f}), Tensor(du.data(), {n, f}));
  EXPECT_LT(check_grad("swiglu dgate", loss, g.data(), dg.data(), n * f).rel_err, kGradTol);
  EXPECT_LT(check_grad("swiglu dup", loss, u.data(), du.data(), n * f).rel_err, kGradTol);
}

TEST(OpEmbedding, LookupAndScatterAddGradCheck) {
  const std::int64_t v = 7, d = 5, n = 6;
  std::vector<std::uint32_t> ids = {3, 0, 3, 6, 2, 3};  // repeated ids must add up in backward
  auto table = random_vector(v * d, 30), r = random_vector(n * d, 31);
  std::vector<float> out(n * d), dtable(v * d, 0.f);
  Tensor tt(table.data(), {v, d}), to(out.data(), {n, d});
  auto loss = [&] {
    ops::embedding::forward(ids.data(), n, tt, to);
    return weighted_sum(out.data(), r);
  };
  loss();
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < d; ++j) EXPECT_EQ(out[i * d + j], table[ids[i] * d + j]);
  ops::embedding::backward(ids.data(), n, Tensor(r.data(), {n, d}), Tensor(dtable.data(), {v, d}));
  for (std::int64_t j = 0; j < d; ++j) {
    EXPECT_NEAR(dtable[3 * d + j], r[0 * d + j] + r[2 * d + j] + r[5 * d + j], 1e-6);
    EXPECT_EQ(dtable[1 * d + j], 0.f);  // unused rows get no gradient
  }
  EXPECT_LT(check_grad("embedding dtable", loss, table.data(), dtable.data(), v * d).rel_err, kGradTol);
}

TEST(OpEmbedding, RejectsOutOfRangeId) {
  std::vector<float> table(4 * 2), out(2 * 2);
  std::vector<std::uint32_t> ids = {1, 4};
  EXPECT_THROW(ops::embedding::forward(ids.data(), 2, Tensor(table.data(), {4, 2}), Tensor(out.data(), {2, 2})), Error);
}

}  // namespace
}  // namespace keel

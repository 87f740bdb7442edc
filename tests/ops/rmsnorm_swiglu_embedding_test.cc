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
  std::vector<float> y(n * d), rstd(n), dx(n * d), dw(d, 0.f);
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
  std::vector<float> y(n * d), rstd(n), dx(n * d), dw(d, 0.f);
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

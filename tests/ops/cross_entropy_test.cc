#include "ops/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>

#include "common/error.h"
#include "gradcheck.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
namespace ce = ops::cross_entropy;

struct CeCase {
  std::int64_t n, d, v;
  std::vector<float> h, w;
  std::vector<std::int32_t> targets;
  std::vector<float> lse, scratch;
  CeCase(std::int64_t n_, std::int64_t d_, std::int64_t v_, std::vector<std::int32_t> t)
      : n(n_), d(d_), v(v_), h(random_vector(n_ * d_, 80)), w(random_vector(v_ * d_, 81, 0.7f)), targets(std::move(t)), lse(n_) {}
  Tensor th() { return Tensor(h.data(), {n, d}); }
  Tensor tw() { return Tensor(w.data(), {v, d}); }
  float forward(const ce::Options& o) {
    scratch.assign(ce::scratch_floats(n, std::min(o.chunk, v)), 0.f);
    return ce::forward(th(), tw(), targets.data(), o, Tensor(lse.data(), {n}), Tensor(scratch.data(), {std::int64_t(scratch.size())}));
  }
  void backward(const ce::Options& o, float dloss, std::vector<float>& dh, std::vector<float>& dw) {
    dh.assign(n * d, 0.f);
    dw.assign(v * d, 0.f);
    ce::backward(th(), tw(), targets.data(), Tensor(lse.data(), {n}), dloss, o,
                 Tensor(scratch.data(), {std::int64_t(scratch.size())}), Tensor(dh.data(), {n, d}), Tensor(dw.data(), {v, d}));
  }
};

// Full [N, V] logits in double: the straightforward cross-entropy and its gradients.
struct FullCe {
  double loss = 0;
  std::vector<double> lse, dh, dw;
};
FullCe full_ce(const CeCase& c, std::int32_t ignore) {
  FullCe f;
  f.lse.assign(c.n, 0);
  f.dh.assign(c.n * c.d, 0);
  f.dw.assign(c.v * c.d, 0);
  std::int64_t valid = 0;
  for (auto t : c.targets) valid += t != ignore;
  for (std::int64_t i = 0; i < c.n; ++i) {
    if (c.targets[i] == ignore) continue;
    std::vector<double> l(c.v);
    double m = -1e300;
    for (std::int64_t j = 0; j < c.v; ++j) {
      for (std::int64_t x = 0; x < c.d; ++x) l[j] += double(c.h[i * c.d + x]) * c.w[j * c.d + x];
      m = std::max(m, l[j]);
    }
    double z = 0;
    for (double x : l) z += std::exp(x - m);
    f.lse[i] = m + std::log(z);
    f.loss += (f.lse[i] - l[c.targets[i]]) / double(valid);
    for (std::int64_t j = 0; j < c.v; ++j) {
      double g = (std::exp(l[j] - f.lse[i]) - (j == c.targets[i] ? 1 : 0)) / double(valid);
      for (std::int64_t x = 0; x < c.d; ++x) {
        f.dh[i * c.d + x] += g * c.w[j * c.d + x];
        f.dw[j * c.d + x] += g * c.h[i * c.d + x];
      }
    }
  }
  return f;
}

TEST(OpCrossEntropy, ChunkedMatchesFullLogitsForEveryChunkSize) {
  CeCase c(7, 6, 23, {3, 22, -1, 0, 11, 5, 22});
  const FullCe ref = full_ce(c, -1);
  for (std::int64_t chunk : {1, 4, 5, 7, 22, 23, 64}) {  // 4, 5, 7, 22 leave a short last chunk
    ce::Options o;
    o.chunk = chunk;
    const float loss = c.forward(o);
    EXPECT_NEAR(loss, ref.loss, 1e-5) << "chunk " << chunk;
    for (std::int64_t i = 0; i < c.n; ++i) EXPECT_NEAR(c.lse[i], ref.lse[i], 1e-5) << "chunk " << chunk;
    std::vector<float> dh, dw;
    c.backward(o, 1.f, dh, dw);
    for (std::size_t i = 0; i < dh.size(); ++i) EXPECT_NEAR(dh[i], ref.dh[i], 1e-5) << "chunk " << chunk;
    for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], ref.dw[i], 1e-5) << "chunk " << chunk;
    EXPECT_EQ(c.lse[2], 0.f);  // ignored row
    for (std::int64_t x = 0; x < c.d; ++x) EXPECT_EQ(dh[2 * c.d + x], 0.f);
  }
}

// More rows and a wider vocabulary: threaded row loops, several GEMM chunks, a short tail.
TEST(OpCrossEntropy, LargerChunkedMatchesFullLogits) {
  std::vector<std::int32_t> t(48);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = i % 11 == 5 ? -1 : std::int32_t((i * 37) % 301);
  CeCase c(48, 16, 301, t);
  const FullCe ref = full_ce(c, -1);
  ce::Options o;
  o.chunk = 64;
  EXPECT_NEAR(c.forward(o), ref.loss, 1e-4);
  std::vector<float> dh, dw;
  c.backward(o, 1.f, dh, dw);
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < dw.size(); ++i) {
    err += (dw[i] - ref.dw[i]) * (dw[i] - ref.dw[i]);
    norm += ref.dw[i] * ref.dw[i];
  }
  for (std::size_t i = 0; i < dh.size(); ++i) {
    err += (dh[i] - ref.dh[i]) * (dh[i] - ref.dh[i]);
    norm += ref.dh[i] * ref.dh[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
}

TEST(OpCrossEntropy, GradCheckWithIgnoreIndex) {
  // A configured pad id (2) is ignored as a target but stays an ordinary vocabulary column.
  for (std::int32_t ignore : {-1, 2}) {
    CeCase c(6, 8, 13, {4, ignore, 12, 2 == ignore ? 7 : 2, 0, 9});
    ce::Options o;
    o.chunk = 4;
    o.ignore_index = ignore;
    const float dloss = 0.7f;
    c.forward(o);
    std::vector<float> dh, dw;
    c.backward(o, dloss, dh, dw);
    auto loss = [&] { return double(dloss) * c.forward(o); };
    const std::string tag = " (ignore " + std::to_string(ignore) + ", chunk 4, V 13)";
    EXPECT_LT(check_grad("cross_entropy dhidden" + tag, loss, c.h.data(), dh.data(), c.h.size()).rel_err, kGradTol);
    EXPECT_LT(check_grad("cross_entropy dW" + tag, loss, c.w.data(), dw.data(), c.w.size()).rel_err, kGradTol);
  }
}

TEST(OpCrossEntropy, AllIgnoredGivesZeroLossAndGradients) {
  CeCase c(3, 4, 5, {-1, -1, -1});
  ce::Options o;
  o.chunk = 2;
  EXPECT_EQ(c.forward(o), 0.f);
  std::vector<float> dh, dw;
  c.backward(o, 1.f, dh, dw);
  for (float g : dh) EXPECT_EQ(g, 0.f);
  for (float g : dw) EXPECT_EQ(g, 0.f);
}

TEST(OpCrossEntropy, RejectsTargetOutsideVocabulary) {
  CeCase c(2, 4, 5, {1, 5});
  EXPECT_THROW(c.forward(ce::Options{}), Error);
}

}  // namespace
}  // namespace keel

#include "ops/linear.h"

#include <gtest/gtest.h>

#include "gradcheck.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
using test::weighted_sum;

struct LinearCase {
  std::int64_t n = 5, in = 7, out = 6;
  std::vector<float> x = random_vector(n * in, 1), w = random_vector(out * in, 2, 0.5f), b = random_vector(out, 3),
                     r = random_vector(n * out, 4), y = std::vector<float>(n * out);
  Tensor tx() { return Tensor(x.data(), {n, in}); }
  Tensor tw() { return Tensor(w.data(), {out, in}); }
  Tensor tb() { return Tensor(b.data(), {out}); }
  Tensor ty() { return Tensor(y.data(), {n, out}); }
  double loss(bool bias) {
    ops::linear::forward(tx(), tw(), bias ? tb() : Tensor(), ty());
    return weighted_sum(y.data(), r);
  }
};

TEST(OpLinear, ForwardMatchesNaive) {
  LinearCase c;
  c.loss(true);
  for (std::int64_t i = 0; i < c.n; ++i)
    for (std::int64_t o = 0; o < c.out; ++o) {
      double s = c.b[o];
      for (std::int64_t k = 0; k < c.in; ++k) s += double(c.x[i * c.in + k]) * c.w[o * c.in + k];
      EXPECT_NEAR(c.y[i * c.out + o], s, 1e-5);
    }
}

TEST(OpLinear, GradCheck) {
  for (bool bias : {true, false}) {
    LinearCase c;
    c.loss(bias);
    std::vector<float> dx(c.x.size()), dw(c.w.size(), 0.f), db(c.b.size(), 0.f);
    Tensor dy(c.r.data(), {c.n, c.out});
    ops::linear::backward(c.tx(), c.tw(), dy, Tensor(dx.data(), {c.n, c.in}), Tensor(dw.data(), {c.out, c.in}),
                          bias ? Tensor(db.data(), {c.out}) : Tensor());
    auto loss = [&] { return c.loss(bias); };
    EXPECT_LT(check_grad("linear dx", loss, c.x.data(), dx.data(), c.x.size()).rel_err, kGradTol);
    EXPECT_LT(check_grad("linear dW", loss, c.w.data(), dw.data(), c.w.size()).rel_err, kGradTol);
    if (bias) {
      EXPECT_LT(check_grad("linear db", loss, c.b.data(), db.data(), c.b.size()).rel_err, kGradTol);
    }
  }
}

TEST(OpLinear, ParameterGradientsAccumulate) {
  LinearCase c;
  std::vector<float> dw(c.w.size(), 1.f), db(c.b.size(), 1.f), dw1(c.w.size(), 0.f), db1(c.b.size(), 0.f);
  Tensor dy(c.r.data(), {c.n, c.out});
  ops::linear::backward(c.tx(), c.tw(), dy, Tensor(), Tensor(dw.data(), {c.out, c.in}), Tensor(db.data(), {c.out}));
  ops::linear::backward(c.tx(), c.tw(), dy, Tensor(), Tensor(dw1.data(), {c.out, c.in}), Tensor(db1.data(), {c.out}));
  for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], dw1[i] + 1.f, 1e-5);
  for (std::size_t i = 0; i < db.size(); ++i) EXPECT_NEAR(db[i], db1[i] + 1.f, 1e-5);
}

TEST(OpLinear, RejectsMismatchedShapes) {
  LinearCase c;
  EXPECT_THROW(ops::linear::forward(c.tx(), Tensor(c.w.data(), {c.in, c.out}), Tensor(), c.ty()), Error);
}

// The check must be able to fail: a gradient 2% too large, or with one element's sign flipped,
// is caught at the tolerance every op test uses.
TEST(OpGradCheck, DetectsBrokenGradient) {
  LinearCase c;
  c.loss(true);
  std::vector<float> dx(c.x.size()), dw(c.w.size(), 0.f);
  ops::linear::backward(c.tx(), c.tw(), Tensor(c.r.data(), {c.n, c.out}), Tensor(dx.data(), {c.n, c.in}),
                        Tensor(dw.data(), {c.out, c.in}), Tensor());
  auto loss = [&] { return c.loss(true); };
  std::vector<float> scaled = dw;
  for (auto& g : scaled) g *= 1.02f;
  EXPECT_GT(check_grad("broken linear dW (x1.02)", loss, c.w.data(), scaled.data(), c.w.size()).rel_err, kGradTol);
  std::vector<float> flipped = dx;
  flipped[3] = -flipped[3];
  EXPECT_GT(check_grad("broken linear dx (one sign)", loss, c.x.data(), flipped.data(), c.x.size()).rel_err, kGradTol);
}

}  // namespace
}  // namespace keel

// Ops composed the way the model uses them: embedding -> RMSNorm -> fused cross-entropy with the
// LM head tied to the embedding table. Both the embedding scatter-add and the LM-head gradient
// accumulate into one dtable (the "parameter gradients +=" convention), checked end to end.
#include <gtest/gtest.h>

#include "gradcheck.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;

TEST(OpTiedEmbedding, GradCheckThroughRmsNormAndChunkedCrossEntropy) {
  const std::int64_t v = 11, d = 8, n = 6;
  std::vector<std::uint32_t> ids = {1, 4, 4, 9, 0, 10};
  std::vector<std::int32_t> targets = {4, 4, 9, -1, 10, 2};
  auto table = random_vector(v * d, 110), w = random_vector(d, 111);
  std::vector<float> h(n * d), y(n * d), rstd(n), lse(n);
  ops::cross_entropy::Options o;
  o.chunk = 3;
  std::vector<float> scratch(ops::cross_entropy::scratch_floats(n, o.chunk));
  Tensor tt(table.data(), {v, d}), tw(w.data(), {d}), th(h.data(), {n, d}), ty(y.data(), {n, d}), tr(rstd.data(), {n}),
      tl(lse.data(), {n}), ts(scratch.data(), {std::int64_t(scratch.size())});
  auto loss = [&] {
    ops::embedding::forward(ids.data(), n, tt, th);
    ops::rmsnorm::forward(th, tw, 1e-5f, ty, tr);
    return double(ops::cross_entropy::forward(ty, tt, targets.data(), o, tl, ts));
  };
  loss();
  std::vector<float> dtable(v * d, 0.f), dw(d, 0.f), dy(n * d), dh(n * d, 0.f);  // dh starts at 0: rmsnorm adds into it
  ops::cross_entropy::backward(ty, tt, targets.data(), tl, 1.f, o, ts, Tensor(dy.data(), {n, d}), Tensor(dtable.data(), {v, d}));
  ops::rmsnorm::backward(th, tw, tr, Tensor(dy.data(), {n, d}), Tensor(dh.data(), {n, d}), Tensor(dw.data(), {d}));
  ops::embedding::backward(ids.data(), n, Tensor(dh.data(), {n, d}), Tensor(dtable.data(), {v, d}));
  EXPECT_LT(check_grad("tied embedding dtable (embed + lm head)", loss, table.data(), dtable.data(), table.size()).rel_err, kGradTol);
  EXPECT_LT(check_grad("tied embedding dnorm_w", loss, w.data(), dw.data(), w.size()).rel_err, kGradTol);
}

}  // namespace
}  // namespace keel

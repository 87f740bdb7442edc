// End to end: parameter groups + clipping + schedule + AdamW + Muon on a small regression.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/muon.h"
#include "optim/schedule.h"
#include "optim_test_util.h"

namespace keel::optim {
namespace {

using testing::randn;

TEST(OptimStep, MuonAndAdamWFitLinearRegression) {
  // y = W x + b with W [16, 32] (Muon) and b [16] (AdamW, no decay); loss = mean 0.5 |r|^2.
  const int out = 16, in = 32, n = 256;
  ParamLayout layout = assign_groups({{"layers.0.proj.weight", {out, in}}, {"layers.0.proj.bias", {out}}},
                                     default_rules());
  const ParamInfo& W = layout.params[0];
  const ParamInfo& B = layout.params[1];
  ASSERT_EQ(W.optimizer, OptimizerKind::kMuon);
  ASSERT_EQ(B.optimizer, OptimizerKind::kAdamW);
  auto w_true = randn(out * in, 1, 0.2f), b_true = randn(out, 2, 0.5f);
  auto x = randn(static_cast<std::size_t>(n * in), 3);
  std::vector<float> y(static_cast<std::size_t>(n * out));
  for (int i = 0; i < n; ++i)
    for (int o = 0; o < out; ++o) {
      double s = b_true[o];
      for (int k = 0; k < in; ++k) s += static_cast<double>(w_true[o * in + k]) * x[i * in + k];
      y[i * out + o] = static_cast<float>(s);
    }
  auto params = randn(static_cast<std::size_t>(layout.total_floats), 4, 0.05f);
  std::vector<float> grads(params.size()), m(params.size(), 0.0f), v(m), mom(m);

  auto loss_and_grad = [&]() {
    std::fill(grads.begin(), grads.end(), 0.0f);
    double loss = 0;
    for (int i = 0; i < n; ++i)
      for (int o = 0; o < out; ++o) {
        double r = params[B.offset + o] - y[i * out + o];
        for (int k = 0; k < in; ++k) r += static_cast<double>(params[W.offset + o * in + k]) * x[i * in + k];
        loss += 0.5 * r * r / n;
        grads[B.offset + o] += static_cast<float>(r / n);
        for (int k = 0; k < in; ++k) grads[W.offset + o * in + k] += static_cast<float>(r * x[i * in + k] / n);
      }
    return loss;
  };

  LrSchedule sched;
  sched.kind = ScheduleKind::kCosine;
  sched.peak_lr = 0.05;
  sched.min_lr = 0.001;
  sched.warmup_steps = 5;
  sched.total_steps = 150;
  AdamWConfig ac;
  ac.weight_decay = 0.0;
  MuonConfig mc;
  mc.weight_decay = 0.0;
  AdamW adamw(ac);
  Muon muon(mc);
  const double loss0 = loss_and_grad();
  double loss = loss0;
  int clipped = 0;
  for (int step = 0; step < sched.total_steps; ++step) {
    loss = loss_and_grad();
    ClipResult clip = clip_grad_norm_deferred(grad_views(layout, grads.data()), 1.0);
    clipped += clip.clipped;
    double lr = lr_at(sched, step);
    auto s = static_cast<float>(clip.coefficient);
    adamw.step(layout, {0, layout.total_floats, params.data(), grads.data(), m.data(), v.data()}, lr, s);
    muon.step(layout, params.data(), grads.data(), mom.data(), lr, s);
  }
  loss = loss_and_grad();
  RecordProperty("loss_ratio", testing::sci(loss / loss0));
  EXPECT_GT(clipped, 0);  // the early, large gradients were clipped
  EXPECT_LT(loss, 1e-4 * loss0) << "initial " << loss0 << " final " << loss;
}

}  // namespace
}  // namespace keel::optim

// Finite differences over every parameter of a whole MoeTransformer (tests/ops/gradcheck.h per
// tensor: up to 60 elements each, h = 1e-3): each tensor's relative error under kGradTol and its
// analytic gradient non-zero. Returns the worst relative error.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../ops/gradcheck.h"
#include "train/model.h"
#include "train_test_util.h"

namespace keel::train::fixtures {

inline double check_model_grads(MoeTransformer& model, const Batch& b, const std::string& tag) {
  model.zero_grads();
  model.forward(b.tokens.data(), b.targets.data());
  model.backward();
  std::vector<float> grads(model.grads(), model.grads() + model.param_floats());
  auto loss = [&] { return model.forward(b.tokens.data(), b.targets.data()).total; };
  double worst = 0;
  for (const auto& p : model.layout().params) {
    const auto r = test::check_grad(p.name, loss, model.params() + p.offset, grads.data() + p.offset, p.numel,
                                    /*eps=*/1e-3, /*max_elems=*/60);
    EXPECT_LT(r.rel_err, test::kGradTol) << tag << " " << p.name;
    EXPECT_GT(r.ana_norm, 0.0) << tag << " " << p.name;
    worst = std::max(worst, r.rel_err);
  }
  return worst;
}

}  // namespace keel::train::fixtures

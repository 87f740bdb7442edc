// The router settings of issue 36, part 4: the MLP router's fan-in init (router.init_gain), the
// balancing rules (router.balance) and the routers' learning rate (router.lr_scale), and their
// config keys. The routing health they give on real text: tests/train/check_routing.py.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/error.h"
#include "model/param_layout.h"
#include "train/model.h"
#include "train/param_rules.h"
#include "train/train_config.h"

#include "train_test_util.h"

namespace keel::train {
namespace {

model::ModelConfig zaya_like() {
  model::ModelConfig cfg = fixtures::tiny_config(true, 3);  // layers 1 and 2 MoE
  cfg.router_hidden = 64;
  cfg.router_mlp_layers = 3;
  cfg.top_k = 1;
  cfg.router_skip_expert = true;
  model::validate(cfg);
  return cfg;
}

double rms_of(const optim::ParamLayout& layout, const std::vector<float>& v, const std::string& name) {
  for (const auto& p : layout.params)
    if (p.name == name) {
      double s = 0;
      for (std::int64_t i = 0; i < p.numel; ++i) s += double(v[p.offset + i]) * v[p.offset + i];
      return std::sqrt(s / double(p.numel));
    }
  ADD_FAILURE() << "no parameter " << name;
  return 0;
}

TEST(RouterBalance, InitGainScalesTheRouterMlpByFanIn) {
  const auto cfg = zaya_like();
  const auto layout = model::param_layout(cfg);
  std::vector<float> base(layout.total_floats), scaled(layout.total_floats);
  model::init_parameters(cfg, layout, 0.02, 5, base.data());
  model::init_parameters(cfg, layout, 0.02, 5, scaled.data(), {}, {}, 2.0);
  const double want = 2.0 / std::sqrt(64.0);  // gain / sqrt(router_hidden)
  for (const char* n : {"layers.1.moe.router.mlp1.weight", "layers.1.moe.router.mlp2.weight",
                        "layers.2.moe.router.out.weight"}) {
    EXPECT_NEAR(rms_of(layout, scaled, n), want, 0.15 * want) << n;
    EXPECT_NEAR(rms_of(layout, base, n), 0.02, 0.004) << n;
  }
  // The same draws scaled: everything else, the router's down projection included, unchanged.
  for (const auto& p : layout.params) {
    const bool mlp = p.name.find(".moe.router.") != std::string::npos && p.ndim() == 2 &&
                     !p.name.ends_with("router.down.weight");
    for (std::int64_t i = 0; i < p.numel; i += 97) {
      const float a = base[p.offset + i], b = scaled[p.offset + i];
      if (mlp) EXPECT_NEAR(b, a * want / 0.02, 1e-5 * std::abs(b) + 1e-7) << p.name;
      else ASSERT_EQ(a, b) << p.name;
    }
  }
}

ops::bias_controller::Config controller(ops::bias_controller::Rule rule, double rate, double kp = 0, double kd = 0) {
  ops::bias_controller::Config c;
  c.rule = rule;
  c.lr = rate;
  c.kp = kp;
  c.kd = kd;
  return c;
}

TEST(RouterBalance, RulesMoveTheBiasTowardTheFairShare) {
  // 3 classes, 12 tokens: shares 1/2, 1/3, 1/6 against 1/3 each.
  const std::vector<std::vector<std::int64_t>> load = {{6, 4, 2}};
  std::vector<std::vector<float>> sign = {{0.f, 0.f, 0.f}}, prop = sign;
  BalanceMemory mem;
  update_balancing_bias(load, controller(ops::bias_controller::Rule::Sign, 0.1), sign, mem);
  EXPECT_FLOAT_EQ(sign[0][0], -0.1f);
  EXPECT_FLOAT_EQ(sign[0][1], 0.f);  // exactly at its share: unchanged
  EXPECT_FLOAT_EQ(sign[0][2], 0.1f);
  update_balancing_bias(load, controller(ops::bias_controller::Rule::Proportional, 0.6), prop, mem);
  EXPECT_NEAR(prop[0][0], -0.6 * (0.5 - 1.0 / 3), 1e-7);
  EXPECT_NEAR(prop[0][1], 0.0, 1e-7);
  EXPECT_NEAR(prop[0][2], 0.6 * (1.0 / 3 - 1.0 / 6), 1e-7);
  EXPECT_TRUE(mem.m.empty());  // sign and proportional keep no moments
  std::vector<std::vector<float>> none = {{0.5f, 0.f, 0.f}};
  update_balancing_bias({{0, 0, 0}}, controller(ops::bias_controller::Rule::Proportional, 0.1), none, mem);  // no tokens
  EXPECT_EQ(none[0][0], 0.5f);
}

// The pid rule by hand on one class: the bias is -rate sum e - kp e_t - kd (e_t - e_{t-1}), its
// memory the last two errors; with kp = kd = 0 it is the proportional rule exactly.
TEST(RouterBalance, PidRuleByHand) {
  // 2 classes: errors f_0 - 1/2 of 0.25, 0.125, -0.25 on three steps.
  const std::vector<std::vector<std::vector<std::int64_t>>> loads = {{{6, 2}}, {{5, 3}}, {{2, 6}}};
  const double rate = 0.1, kp = 0.5, kd = 0.2, e[3] = {0.25, 0.125, -0.25};
  std::vector<std::vector<float>> bias = {{0.f, 0.f}}, prop = bias, pid0 = bias;
  BalanceMemory mem, prop_mem, pid0_mem;
  double sum = 0;
  for (int t = 0; t < 3; ++t) {
    update_balancing_bias(loads[t], controller(ops::bias_controller::Rule::Pid, rate, kp, kd), bias, mem);
    update_balancing_bias(loads[t], controller(ops::bias_controller::Rule::Proportional, rate), prop, prop_mem);
    update_balancing_bias(loads[t], controller(ops::bias_controller::Rule::Pid, rate), pid0, pid0_mem);
    sum += e[t];
    const double prev = t > 0 ? e[t - 1] : 0.0;
    EXPECT_NEAR(bias[0][0], -rate * sum - kp * e[t] - kd * (e[t] - prev), 1e-6) << "step " << t;
    EXPECT_NEAR(bias[0][1], rate * sum + kp * e[t] + kd * (e[t] - prev), 1e-6) << "step " << t;
    EXPECT_FLOAT_EQ(mem.m[0][0], static_cast<float>(e[t]));
    EXPECT_FLOAT_EQ(mem.v[0][0], static_cast<float>(prev));
    EXPECT_EQ(mem.rule, ops::bias_controller::Rule::Pid);
    EXPECT_EQ(pid0, prop) << "step " << t;
  }
  EXPECT_TRUE(prop_mem.m.empty());
  // Memory another rule wrote is not read: it starts again at zero.
  BalanceMemory adam_mem;
  std::vector<std::vector<float>> a = {{0.f, 0.f}}, b = a;
  update_balancing_bias(loads[0], controller(ops::bias_controller::Rule::Adam, 0.01), a, adam_mem);
  ASSERT_FALSE(adam_mem.m.empty());
  BalanceMemory none;
  a = b;
  update_balancing_bias(loads[1], controller(ops::bias_controller::Rule::Pid, rate, kp, kd), a, adam_mem);
  update_balancing_bias(loads[1], controller(ops::bias_controller::Rule::Pid, rate, kp, kd), b, none);
  EXPECT_EQ(a, b);
  EXPECT_EQ(adam_mem.m, none.m);
  EXPECT_EQ(adam_mem.updates, 1);
}

// ZAYA1's controller (AdamW on the bias, as Primus): keel train's update of every layer is the
// op's, step after step, with the moments and the update count carried between calls; a layer
// that saw no tokens keeps its bias. Adam's first step moves each bias by lr against the sign
// of its error.
TEST(RouterBalance, AdamRuleIsTheControllerOpWithItsMomentsCarried) {
  const std::vector<std::vector<std::vector<std::int64_t>>> loads = {
      {{9, 2, 1, 0}, {3, 3, 3, 3}}, {{7, 3, 1, 1}, {0, 0, 0, 0}}, {{4, 4, 2, 2}, {6, 2, 2, 2}}};
  std::vector<std::vector<float>> bias = {{0.f, 0.f, 0.f, -1.f}, {0.f, 0.f, 0.f, -1.f}};
  BalanceMemory mem;
  std::vector<ops::bias_controller::State> want(2, ops::bias_controller::init(4, true));
  ops::bias_controller::Config c;
  c.lr = 0.003;
  for (std::size_t step = 0; step < loads.size(); ++step) {
    update_balancing_bias(loads[step], c, bias, mem);
    for (std::size_t l = 0; l < 2; ++l) {
      want[l].step = static_cast<std::int64_t>(step);  // one count for all layers: keel's updates
      want[l] = ops::bias_controller::update(c, want[l], loads[step][l].data());
      EXPECT_EQ(bias[l], want[l].bias) << "step " << step << " layer " << l;
      if (loads[step][l][0] + loads[step][l][1] > 0) {
        EXPECT_EQ(mem.m[l], want[l].m);
        EXPECT_EQ(mem.v[l], want[l].v);
      }
    }
    if (step == 0) {
      EXPECT_FLOAT_EQ(bias[0][0], -0.003f);  // overloaded: lowered by lr
      EXPECT_FLOAT_EQ(bias[0][3], -1.f + 0.003f);  // the skip class, unused: raised by lr
      EXPECT_EQ(bias[1], (std::vector<float>{0.f, 0.f, 0.f, -1.f}));  // exactly balanced
    }
    EXPECT_EQ(mem.updates, static_cast<std::int64_t>(step + 1));
  }
}

TEST(RouterBalance, LrScaleAppliesToTheRoutersOnly) {
  auto layout = model::param_layout(zaya_like());
  scale_router_lr(layout, 0.1);
  int routers = 0;
  for (const auto& p : layout.params) {
    const bool router = p.name.find(".moe.router") != std::string::npos;
    routers += router;
    EXPECT_DOUBLE_EQ(p.lr_scale, router ? 0.1 : 1.0) << p.name;
  }
  EXPECT_GT(routers, 10);
  EXPECT_THROW(scale_router_lr(layout, -1), Error);
}

TEST(RouterBalance, ConfigKeys) {
  const std::string text = fixtures::train_config_text("/nonexistent/data", "/tmp/keel-router-out");
  const TrainConfig c = parse_train_config(
      text, "t.yaml", {"router.balance=proportional", "router.init_gain=0.5", "router.lr_scale=0.1"});
  EXPECT_EQ(c.model_options.balance_rule, ops::bias_controller::Rule::Proportional);
  EXPECT_DOUBLE_EQ(c.model_options.router_init_gain, 0.5);
  EXPECT_DOUBLE_EQ(c.model_options.router_lr_scale, 0.1);
  EXPECT_EQ(parse_train_config(text, "t.yaml", {"router.balance=adam"}).model_options.balance_rule,
            ops::bias_controller::Rule::Adam);
  const TrainConfig d = parse_train_config(text, "t.yaml");
  EXPECT_EQ(d.model_options.balance_rule, ops::bias_controller::Rule::Sign);
  EXPECT_DOUBLE_EQ(d.model_options.router_init_gain, 1.0);  // keel train's fan-in init
  EXPECT_DOUBLE_EQ(d.model_options.router_lr_scale, 1.0);
  // ZAYA1's MLP router without router.* keys: the defaults measured to keep it balanced
  // (docs/PERFORMANCE.md, "Routing health, third pass"); a key given wins.
  const std::vector<std::string> mlp = {"model.router_hidden=8", "model.router_mlp_layers=3", "model.top_k=1"};
  const TrainConfig z = parse_train_config(text, "t.yaml", mlp);
  EXPECT_EQ(z.model_options.balance_rule, ops::bias_controller::Rule::Proportional);
  EXPECT_DOUBLE_EQ(z.model_options.bias_update_rate, 0.01);  // the fixture's router.bias_update_rate
  EXPECT_DOUBLE_EQ(z.model_options.router_lr_scale, 0.02);
  std::string bare = text;  // without it: the default rate
  bare.replace(bare.find("  bias_update_rate: 0.01\n"), std::string("  bias_update_rate: 0.01\n").size(), "");
  EXPECT_DOUBLE_EQ(parse_train_config(bare, "t.yaml", mlp).model_options.bias_update_rate, 0.05);
  // router.aux_loss_weight is the model's router's: the MLP router's own weight (0 unless given:
  // ZAYA1 has no aux loss), the linear router's otherwise.
  EXPECT_DOUBLE_EQ(z.model_options.mlp_router_aux_weight, 0.01);  // the fixture gives 0.01
  EXPECT_DOUBLE_EQ(aux_loss_weight(z.model, z.model_options), 0.01);
  EXPECT_DOUBLE_EQ(parse_train_config(bare, "t.yaml", mlp).model_options.mlp_router_aux_weight, 0.01);
  std::string no_aux = bare;
  no_aux.replace(no_aux.find("  aux_loss_weight: 0.01\n"), std::string("  aux_loss_weight: 0.01\n").size(), "");
  const TrainConfig zn = parse_train_config(no_aux, "t.yaml", mlp);
  EXPECT_DOUBLE_EQ(aux_loss_weight(zn.model, zn.model_options), 0.0);
  EXPECT_DOUBLE_EQ(aux_loss_weight(d.model, d.model_options), 0.01);  // the linear router's
  fixtures::expect_usage_error(text, {"model.router_hidden=8", "model.router_mlp_layers=3", "model.top_k=1",
                                      "router.aux_loss_weight=-1"},
                               "router");
  std::vector<std::string> given = mlp;
  given.push_back("router.lr_scale=0.5");
  EXPECT_DOUBLE_EQ(parse_train_config(text, "t.yaml", given).model_options.router_lr_scale, 0.5);
  fixtures::expect_usage_error(text, {"router.balance=pd"}, "router.balance");
  const TrainConfig pid =
      parse_train_config(text, "t.yaml", {"router.balance=pid", "router.balance_kp=0.3", "router.balance_kd=0.1"});
  EXPECT_EQ(pid.model_options.balance_rule, ops::bias_controller::Rule::Pid);
  EXPECT_DOUBLE_EQ(pid.model_options.balance_kp, 0.3);
  EXPECT_DOUBLE_EQ(pid.model_options.balance_kd, 0.1);
  EXPECT_EQ(balance_config(pid.model_options).kp, 0.3);
  fixtures::expect_usage_error(text, {"router.balance_kp=0.3"}, "router.balance_kp");  // not the pid rule
  fixtures::expect_usage_error(text, {"router.balance=pid", "router.balance_kd=-1"}, "router.balance_kd");
  fixtures::expect_usage_error(text, {"router.init_gain=-1"}, "router.init_gain");
  fixtures::expect_usage_error(text, {"router.lr_scale=nan"}, "router.lr_scale");
  fixtures::expect_usage_error(text, {"router.balanse=sign"}, "balanse");
}

}  // namespace
}  // namespace keel::train

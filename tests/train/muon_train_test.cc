// Muon in keel train on the CPU: the group rules (offsets unchanged, matrices to Muon), one
// backend step equal bit for bit to optim's AdamW and Muon on the same clipped gradients, a loss
// that falls, bit-exact resume through a checkpoint, and clear errors for bad `optimizer.muon`
// keys and for Muon momentum resumed into an AdamW run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <tuple>
#include <string>
#include <vector>

#include "common/error.h"
#include "data/indexed_dataset.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/muon.h"
#include "train/backend.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "common/fileio.h"
#include "train/param_rules.h"
#include "train/train_checkpoint.h"
#include "train/trainer.h"

#include "resume_test_util.h"
#include "train_test_util.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;

ModelOptions tiny_options() {
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 8;
  return o;
}

MuonTrainOptions muon_on() {
  MuonTrainOptions m;
  m.enabled = true;
  return m;
}

const optim::ParamInfo& find(const optim::ParamLayout& l, const std::string& name) {
  for (const auto& p : l.params)
    if (p.name == name) return p;
  throw Error("no parameter " + name);
}

TEST(TrainParamRules, AdamWRulesMatchTheModelLayout) {
  for (bool tied : {false, true}) {
    const auto layout = model::param_layout(fixtures::tiny_config(tied));
    const auto again = regroup_layout(layout, train_group_rules(MuonTrainOptions{}));
    ASSERT_EQ(again.params.size(), layout.params.size());
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      const auto &a = layout.params[i], &b = again.params[i];
      EXPECT_EQ(a.group, b.group) << a.name;
      EXPECT_EQ(a.optimizer, b.optimizer) << a.name;
      EXPECT_EQ(a.weight_decay, b.weight_decay) << a.name;
      EXPECT_EQ(a.lr_scale, b.lr_scale) << a.name;
      EXPECT_EQ(a.offset, b.offset) << a.name;
    }
  }
}

// ZAYA1 layers: CCA (conv weights, temperatures), the MLP router, residual scales.
model::ModelConfig zaya_config() {
  model::ModelConfig m = fixtures::tiny_config(false);
  m.attention = model::AttentionKind::kCca;
  m.cca_q_dim = 16, m.cca_k_dim = 8, m.cca_v_dim = 8, m.cca_conv_width = 2, m.cca_group_conv_width = 2;
  m.router_hidden = 8;
  m.router_mlp_layers = 3;
  m.top_k = 1;
  m.residual_scaling = true;
  return m;
}

TEST(TrainParamRules, ZayaLayersGroups) {
  const auto base = model::param_layout(zaya_config());
  const auto again = regroup_layout(base, train_group_rules(MuonTrainOptions{}));
  for (std::size_t i = 0; i < base.params.size(); ++i) {
    EXPECT_EQ(again.params[i].group, base.params[i].group) << base.params[i].name;
    EXPECT_EQ(again.params[i].weight_decay, base.params[i].weight_decay) << base.params[i].name;
  }
  const auto l = regroup_layout(base, train_group_rules(muon_on()));
  for (const auto& p : l.params) {
    const bool conv = p.name.find("conv") != std::string::npos;
    const bool muon = p.ndim() >= 2 && !conv && p.name != "embed.weight" && p.name != "lm_head.weight";
    EXPECT_EQ(p.optimizer, muon ? optim::OptimizerKind::kMuon : optim::OptimizerKind::kAdamW) << p.name;
    if (conv && p.ndim() >= 2) EXPECT_EQ(p.group, "convs") << p.name;
  }
}

TEST(TrainParamRules, MuonRulesTakeTheMatricesAndKeepOffsets) {
  const auto base = model::param_layout(fixtures::tiny_config(false));
  MuonTrainOptions m = muon_on();
  m.lr_scale = 0.5;
  const auto l = regroup_layout(base, train_group_rules(m));
  ASSERT_EQ(l.total_floats, base.total_floats);
  for (std::size_t i = 0; i < l.params.size(); ++i) {
    const auto& p = l.params[i];
    EXPECT_EQ(p.offset, base.params[i].offset) << p.name;
    EXPECT_EQ(p.name, base.params[i].name);
    const bool matrix = p.ndim() >= 2 && p.name != "embed.weight" && p.name != "lm_head.weight";
    EXPECT_EQ(p.optimizer, matrix ? optim::OptimizerKind::kMuon : optim::OptimizerKind::kAdamW) << p.name;
    EXPECT_EQ(p.lr_scale, matrix ? 0.5 : 1.0) << p.name;
    EXPECT_EQ(p.weight_decay, p.ndim() >= 2) << p.name;
  }
  EXPECT_EQ(find(l, "layers.1.moe.w_up").matrices(), 4);  // the expert stack: 4 matrices [12, 16]
  EXPECT_EQ(find(l, "layers.1.moe.router").optimizer, optim::OptimizerKind::kMuon);

  // routers kept on AdamW by glob
  m.adamw_matrices = "*router*";
  const auto k = regroup_layout(base, train_group_rules(m));
  EXPECT_EQ(find(k, "layers.1.moe.router").optimizer, optim::OptimizerKind::kAdamW);
  EXPECT_EQ(find(k, "layers.1.moe.router").group, "matrices_adamw");
  EXPECT_TRUE(find(k, "layers.1.moe.router").weight_decay);
  EXPECT_EQ(find(k, "layers.1.moe.w_gate").optimizer, optim::OptimizerKind::kMuon);
  const auto share = optimizer_share(k, optim::OptimizerKind::kMuon);
  EXPECT_EQ(share.tensors, 4 + 3 + 4 + 3);  // wq wk wv wo per layer, dense mlp, experts
}

// One backend step against optim's own AdamW and Muon on the same gradients and clip
// coefficient: bit for bit (the same code on the same inputs), clipping active.
TEST(MuonTrain, BackendStepIsAdamWPlusMuon) {
  const auto cfg = fixtures::tiny_config(false);
  optim::AdamWConfig ac;
  ac.weight_decay = 0.05;
  MuonTrainOptions mo = muon_on();
  mo.lr_scale = 0.7;
  mo.config.weight_decay = 0.02;
  auto b = make_cpu_backend(cfg, tiny_options(), OptimizerConfig(ac, mo), parallel::Mesh());
  const auto& layout = b->layout();
  const fixtures::Batch batch = fixtures::random_batch(16, 23, 3);
  const double lr = 3e-3, max_norm = 0.05;
  for (int step = 1; step <= 2; ++step) {  // the second step sees non-zero momentum
    b->zero_grads();
    b->forward(batch.tokens.data(), batch.targets.data());
    b->backward(1.0f);
    std::vector<float> g = b->gradients();
    const TrainState before = b->state();
    const StepResult r = b->clip_and_step(max_norm, lr);
    const TrainState after = b->state();
    const auto clip = optim::clip_grad_norm_deferred(optim::grad_views(layout, g.data()), max_norm);
    ASSERT_EQ(r.grad_norm, clip.norm);
    ASSERT_LT(clip.coefficient, 1.0) << "clipping should be active";
    std::vector<float> p = before.params, m = before.adam_m, v = before.adam_v;
    std::vector<float> scratch(static_cast<std::size_t>(muon_scratch_floats(layout)));
    for (const auto& q : layout.params) {
      const std::int64_t o = q.offset;
      if (q.optimizer == optim::OptimizerKind::kAdamW)
        optim::adamw_update(&p[o], &g[o], &m[o], &v[o], q.numel, ac, step, lr * q.lr_scale, q.weight_decay,
                            static_cast<float>(clip.coefficient));
      else
        optim::muon_matrix_step(&p[o], &g[o], &m[o], q.matrices(), q.rows(), q.cols(), mo.config, lr * q.lr_scale,
                                q.weight_decay, static_cast<float>(clip.coefficient), scratch.data());
    }
    for (const auto& q : layout.params) {
      const auto o = static_cast<std::size_t>(q.offset), n = static_cast<std::size_t>(q.numel);
      EXPECT_EQ(0, std::memcmp(&after.params[o], &p[o], n * sizeof(float))) << q.name << " step " << step;
      EXPECT_EQ(0, std::memcmp(&after.adam_m[o], &m[o], n * sizeof(float))) << q.name << " step " << step;
      EXPECT_EQ(0, std::memcmp(&after.adam_v[o], &v[o], n * sizeof(float))) << q.name << " step " << step;
      bool moved = false, v_zero = true;
      for (std::size_t i = o; i < o + n; ++i) moved |= after.params[i] != before.params[i], v_zero &= after.adam_v[i] == 0.f;
      EXPECT_TRUE(moved) << q.name << " did not change";
      if (q.optimizer == optim::OptimizerKind::kMuon) EXPECT_TRUE(v_zero) << q.name << ": Muon leaves v at zero";
    }
    EXPECT_EQ(after.adamw_step, step);
  }
}

TEST(MuonTrain, OverfitsOneBatch) {
  const auto cfg = fixtures::tiny_config(true);
  optim::AdamWConfig ac;
  ac.weight_decay = 0.0;
  auto b = make_cpu_backend(cfg, tiny_options(), OptimizerConfig(ac, muon_on()), parallel::Mesh());
  const fixtures::Batch batch = fixtures::random_batch(16, 23, 5);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    b->zero_grads();
    const double ce = b->forward(batch.tokens.data(), batch.targets.data()).ce;
    b->backward(1.0f);
    if (step == 0) first = ce;
    last = ce;
    b->clip_and_step(1.0, 2e-2);
    b->update_router_bias();
  }
  std::printf("[muon overfit] ce %.4f -> %.4f\n", first, last);
  EXPECT_LT(last, 0.2 * first);
}

TEST(MuonTrain, MuonStateIntoAnAdamWRunIsRefused) {
  const auto cfg = fixtures::tiny_config(false);
  auto muon = make_cpu_backend(cfg, tiny_options(), OptimizerConfig({}, muon_on()), parallel::Mesh());
  const fixtures::Batch batch = fixtures::random_batch(16, 23, 9);
  muon->zero_grads();
  muon->forward(batch.tokens.data(), batch.targets.data());
  muon->backward(1.0f);
  muon->clip_and_step(1.0, 1e-3);
  const TrainState st = muon->state();
  auto adamw = make_cpu_backend(cfg, tiny_options(), {}, parallel::Mesh());
  try {
    adamw->set_state(st);
    FAIL() << "accepted Muon momentum for AdamW parameters";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Muon momentum"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("optimizer.muon.enabled"), std::string::npos) << e.what();
  }
  // AdamW state into a Muon run: a warm start, accepted
  auto other = make_cpu_backend(cfg, tiny_options(), OptimizerConfig({}, muon_on()), parallel::Mesh());
  adamw->zero_grads();
  adamw->forward(batch.tokens.data(), batch.targets.data());
  adamw->backward(1.0f);
  adamw->clip_and_step(1.0, 1e-3);
  EXPECT_NO_THROW(other->set_state(adamw->state()));
}

TEST(MuonTrain, SecondMomentsAreKeptOnlyForAdamWParameters) {
  // Flat layout: a, b AdamW (padding between them), c Muon, d AdamW, e Muon.
  auto info = [](const char* name, std::int64_t offset, std::int64_t numel, bool muon) {
    optim::ParamInfo p;
    p.name = name;
    p.shape = muon ? std::vector<std::int64_t>{4, numel / 4} : std::vector<std::int64_t>{numel};
    p.optimizer = muon ? optim::OptimizerKind::kMuon : optim::OptimizerKind::kAdamW;
    p.offset = offset;
    p.numel = numel;
    return p;
  };
  optim::ParamLayout l;
  l.params = {info("a", 0, 5, false), info("b", 16, 3, false), info("c", 32, 16, true), info("d", 48, 2, false),
              info("e", 64, 16, true)};
  l.total_floats = 80;
  auto spans = [&](StateSlice s) {
    std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>> out;
    for (const MomentSpan& sp : adamw_moment_spans(l, s)) out.emplace_back(sp.begin, sp.count, sp.at);
    return out;
  };
  using T = std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>>;
  EXPECT_EQ(spans({1, 0, 0, 80, 0, 0}), (T{{0, 19, 0}, {48, 2, 48}}));  // a and b merge across the padding
  EXPECT_EQ(spans({1, 0, 2, 40, 0, 0}), (T{{2, 17, 0}}));               // cut inside a
  // An expert range's moments follow the shard's.
  EXPECT_EQ(spans({2, 1, 10, 40, 48, 80}), (T{{16, 3, 6}, {48, 2, 30}}));
  EXPECT_EQ(spans({1, 0, 32, 48, 0, 0}), T{});  // only Muon: no v at all
}

TEST(MuonTrain, CheckpointStoresNoSecondMomentForMuonMatrices) {
  const auto cfg = fixtures::tiny_config(false);
  const fixtures::Batch batch = fixtures::random_batch(16, 23, 9);
  auto trained = [&](const OptimizerConfig& o) {
    auto b = make_cpu_backend(cfg, tiny_options(), o, parallel::Mesh());
    for (int s = 0; s < 2; ++s) {
      b->zero_grads();
      b->forward(batch.tokens.data(), batch.targets.data());
      b->backward(1.0f);
      b->clip_and_step(1.0, 1e-3);
    }
    return b;
  };
  auto save = [](TrainBackend& b, const fs::path& root) {
    TrainCheckpointer ck(root.string(), {});
    ck.save(2, b.state(), b.layout(), {{"sampler", {{"next", 0}}}});
    ck.finish();
  };
  const auto dir = fixtures::temp_dir("muon_train_test", "no_v");
  fs::remove_all(dir);
  auto muon = trained(OptimizerConfig({}, muon_on()));
  save(*muon, dir / "muon");
  {
    const ckpt::Reader r((dir / "muon").string());
    std::set<std::string> stored;
    for (const auto& t : r.metadata().tensors) stored.insert(t.name);
    int muon_params = 0;
    for (const auto& p : muon->layout().params) {
      EXPECT_TRUE(stored.contains("optim/exp_avg/" + p.name)) << p.name;
      const bool adamw = p.optimizer == optim::OptimizerKind::kAdamW;
      EXPECT_EQ(stored.contains("optim/exp_avg_sq/" + p.name), adamw) << p.name;
      muon_params += !adamw;
    }
    EXPECT_GT(muon_params, 0);
  }
  // It resumes a Muon run exactly (v zero at the Muon matrices on both sides).
  const TrainState want = muon->state();
  const LoadedTrainState got = load_train_checkpoint((dir / "muon").string(), cfg);
  EXPECT_EQ(got.state.params, want.params);
  EXPECT_EQ(got.state.adam_m, want.adam_m);
  EXPECT_EQ(got.state.adam_v, want.adam_v);

  // An AdamW checkpoint stores v everywhere; a Muon run takes the AdamW parameters' and keeps
  // none at its matrices.
  auto adamw = trained({});
  save(*adamw, dir / "adamw");
  const TrainState a = adamw->state();
  auto into = make_cpu_backend(cfg, tiny_options(), OptimizerConfig({}, muon_on()), parallel::Mesh());
  into->set_state(load_train_checkpoint((dir / "adamw").string(), cfg).state);
  const TrainState b = into->state();
  for (const auto& p : into->layout().params)
    for (std::int64_t i = p.offset; i < p.offset + p.numel; ++i)
      ASSERT_EQ(b.adam_v[i], p.optimizer == optim::OptimizerKind::kAdamW ? a.adam_v[i] : 0.f) << p.name;

  // keel.train/2 (v stored for every parameter) still loads; another format does not.
  const std::string step_dir = ckpt::latest_dir((dir / "adamw").string());
  const std::string text = read_file(step_dir + "/metadata.json");
  auto with_format = [&](const std::string& f) {
    std::string t = text;
    const std::size_t at = t.find("\"keel.train/3\"");
    EXPECT_NE(at, std::string::npos);
    t.replace(at, 13, "\"" + f);
    write_file_atomically(step_dir + "/metadata.json", t);
  };
  with_format("keel.train/2");
  EXPECT_EQ(load_train_checkpoint(step_dir, cfg).state.adam_v, a.adam_v);
  with_format("keel.train/9");
  try {
    load_train_checkpoint(step_dir, cfg);
    FAIL() << "loaded a checkpoint of an unknown format";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a keel train checkpoint"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(MuonTrain, MemoryReportNamesWhatHoldsTheMemory) {
  auto b = make_cpu_backend(fixtures::tiny_config(false), tiny_options(), OptimizerConfig({}, muon_on()),
                            parallel::Mesh());
  const auto items = b->memory_breakdown();
  ASSERT_EQ(items.size(), 4u);
  for (const auto& it : items) EXPECT_GT(it.bytes, 0u) << it.name;
  EXPECT_GT(b->memory_bytes(), items[0].bytes);
  const std::string line = memory_report(*b);
  EXPECT_EQ(line.rfind("memory on this rank: ", 0), 0u) << line;
  EXPECT_NE(line.find(" = parameters "), std::string::npos) << line;
  EXPECT_NE(line.find(" + optimizer state "), std::string::npos) << line;
}

// --- through the trainer and the config ---

// The tests' train config with Muon on (momentum 0.9).
std::string muon_config_text(const std::string& prefix, const fs::path& out) {
  return fixtures::train_config_text(prefix, out, "  muon:\n    enabled: true\n    momentum: 0.9\n");
}

TEST(MuonTrainConfig, ParsesAndDefaults) {
  const auto dir = fixtures::temp_dir("muon_train_test", "cfg");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const auto c = parse_train_config(muon_config_text(prefix, dir / "o"), "t.yaml",
                                    {"optimizer.muon.scale=exact_rms", "optimizer.muon.lr_scale=0.5",
                                     "optimizer.muon.adamw_matrices='*router*'", "optimizer.muon.nesterov=false"});
  EXPECT_TRUE(c.muon.enabled);
  EXPECT_DOUBLE_EQ(c.muon.config.momentum, 0.9);
  EXPECT_FALSE(c.muon.config.nesterov);
  EXPECT_EQ(c.muon.config.ns_steps, 5);
  EXPECT_EQ(c.muon.config.scale, optim::MuonScale::kExactRms);
  EXPECT_DOUBLE_EQ(c.muon.config.rms_target, 0.2);
  EXPECT_DOUBLE_EQ(c.muon.config.weight_decay, 0.01) << "defaults to optimizer.weight_decay";
  EXPECT_DOUBLE_EQ(c.muon.lr_scale, 0.5);
  EXPECT_EQ(c.muon.adamw_matrices, "*router*");
  const auto d = parse_train_config(muon_config_text(prefix, dir / "o"), "t.yaml", {"optimizer.muon.weight_decay=0"});
  EXPECT_DOUBLE_EQ(d.muon.config.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(d.adamw.weight_decay, 0.01);
  // off unless enabled
  const auto e = parse_train_config(muon_config_text(prefix, dir / "o"), "t.yaml", {"optimizer.muon.enabled=false"});
  EXPECT_FALSE(e.muon.enabled);
}

using fixtures::expect_usage_error;

TEST(MuonTrainConfig, BadKeysGiveClearErrors) {
  const auto dir = fixtures::temp_dir("muon_train_test", "bad");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = muon_config_text(prefix, dir / "o");
  expect_usage_error(good, {"optimizer.muon.beta=0.9"}, "unknown key 'optimizer.muon.beta' (from --set) (known: enabled,");
  expect_usage_error(good, {"optimizer.muon.momentum=1"}, "key 'optimizer.muon.momentum' (from --set): must be in [0, 1)");
  expect_usage_error(good, {"optimizer.muon.momentum=fast"}, "key 'optimizer.muon.momentum' (from --set): must be a number");
  expect_usage_error(good, {"optimizer.muon.ns_steps=0"}, "key 'optimizer.muon.ns_steps' (from --set): must be in [1, 100]");
  expect_usage_error(good, {"optimizer.muon.ns_steps=2.5"}, "optimizer.muon.ns_steps' (from --set): must be an integer");
  expect_usage_error(good, {"optimizer.muon.scale=spectral"},
                     "key 'optimizer.muon.scale' (from --set): unknown Muon scale 'spectral' (match_adamw, exact_rms");
  expect_usage_error(good, {"optimizer.muon.rms_target=0"}, "key 'optimizer.muon.rms_target' (from --set): must be > 0");
  expect_usage_error(good, {"optimizer.muon.lr_scale=-1"}, "key 'optimizer.muon.lr_scale' (from --set): must be >= 0");
  expect_usage_error(good, {"optimizer.muon.weight_decay=-0.1"}, "key 'optimizer.muon.weight_decay' (from --set): must be >= 0");
  expect_usage_error(good, {"optimizer.muon.enabled=maybe"}, "key 'optimizer.muon.enabled' (from --set): must be true or false");
  expect_usage_error(good, {"optimizer.muon=3"}, "key 'optimizer.muon' (from --set): must be a mapping");
  std::string in_file = good;
  in_file.replace(in_file.find("momentum: 0.9"), 13, "momentun: 0.9");
  expect_usage_error(in_file, {}, "bad.yaml: unknown key 'optimizer.muon.momentun' (line");
}

// A 4-D matrix (not a model parameter today) has no Muon rule: a clear error naming it.
TEST(MuonTrainConfig, UnassignableParameterIsNamed) {
  optim::ParamLayout l = optim::assign_groups({{"x.weight", {2, 3}}, {"odd.kernel", {2, 2, 2, 2}}},
                                              train_group_rules(MuonTrainOptions{}));
  try {
    regroup_layout(l, train_group_rules(muon_on()));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'odd.kernel' [2, 2, 2, 2] matches no group rule"), std::string::npos)
        << e.what();
  }
}

TEST(MuonTrain, ResumeIsBitExact) {
  const auto dir = fixtures::temp_dir("muon_train_test", "resume");
  const auto prefix = fixtures::make_dataset(dir, "d");
  auto cfg = parse_train_config(muon_config_text(prefix, dir / "a"), "t.yaml");
  const auto sa = fixtures::expect_resume_bit_exact(cfg, dir / "b", 5);
  ASSERT_EQ(sa.size(), 12u);
  std::printf("[muon trainer] loss %.4f -> %.4f\n", sa.front().loss, sa.back().loss);
  // the Muon run's checkpoint refuses to resume without Muon
  auto off = cfg;
  off.muon.enabled = false;
  Trainer d(off, parallel::Mesh(), true);
  try {
    d.resume((dir / "b").string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Muon momentum"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace keel::train

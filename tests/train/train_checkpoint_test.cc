// keel train state through the keel ckpt library: an asynchronous save that commits, a load
// that restores every tensor bit for bit, and clear errors for the wrong model or file. Under
// tensor parallelism: the boxes of a rank's blocks, the writes of every rank of a mesh tiling
// each tensor once, and checkpoints saved by ranks simulated as threads at one tensor degree
// loaded at another.
#include <gtest/gtest.h>

#include <barrier>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/geometry.h"
#include "ckpt/reader.h"
#include "common/error.h"
#include "model/param_layout.h"
#include "train/backend.h"
#include "train/train_checkpoint.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;

model::ModelConfig tiny(int experts = 4) {
  model::ModelConfig m;
  m.name = "ckpt-tiny";
  m.vocab_size = 31;
  m.hidden = 16;
  m.layers = 2;
  m.attention = model::AttentionKind::kGqa;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 4;
  m.ffn_hidden = 24;
  m.experts = experts;
  m.top_k = 2;
  m.expert_hidden = 12;
  m.first_dense_layers = 1;
  m.tied_embeddings = true;
  m.rope_fraction = 1.0;
  m.max_seq_len = 32;
  return m;
}

ModelOptions options(ops::bias_controller::Rule rule = ops::bias_controller::Rule::Sign) {
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 8;
  o.bias_update_rate = 0.01;
  o.balance_rule = rule;
  if (rule == ops::bias_controller::Rule::Pid) o.balance_kp = 0.02, o.balance_kd = 0.01;
  return o;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("keel_train_ckpt_" + name);
  fs::remove_all(d);
  return d;
}

// Two steps of training so every buffer (params, m, v, router bias) holds non-trivial values.
std::unique_ptr<TrainBackend> trained(const model::ModelConfig& cfg,
                                      ops::bias_controller::Rule rule = ops::bias_controller::Rule::Sign) {
  auto b = make_cpu_backend(cfg, options(rule), {}, parallel::Mesh());
  std::vector<std::uint32_t> tok(16);
  std::vector<std::int32_t> tgt(16);
  for (int i = 0; i < 16; ++i) tok[i] = (i * 7) % cfg.vocab_size, tgt[i] = (i * 5 + 3) % cfg.vocab_size;
  for (int s = 0; s < 2; ++s) {
    b->zero_grads();
    b->forward(tok.data(), tgt.data());
    b->backward(1.0f);
    b->clip_and_step(1.0, 1e-2);
    b->update_router_bias();
  }
  return b;
}

TEST(TrainCheckpoint, SaveCommitsAndLoadRestoresEveryTensorBitForBit) {
  const fs::path root = fresh_dir("roundtrip");
  auto a = trained(tiny());
  const TrainState st = a->state();
  {
    TrainCheckpointer ck(root.string(), {});
    const double stall = ck.save(2, st, a->layout(), {{"sampler", {{"next", 32}}}, {"model", "ckpt-tiny"}});
    EXPECT_GE(stall, 0.0);
    const auto stats = ck.finish();
    ASSERT_TRUE(stats.has_value());
    EXPECT_GT(stats->bytes, 3u * st.params.size());  // params, m, v (padding is not stored)
  }
  EXPECT_TRUE(is_ckpt_directory(root.string()));
  EXPECT_TRUE(fs::exists(root / "latest"));

  auto b = make_cpu_backend(tiny(), options(), {}, parallel::Mesh());
  const LoadedTrainState got = load_train_checkpoint(root.string(), tiny());
  EXPECT_EQ(got.extra.at("step").get<std::int64_t>(), 2);
  EXPECT_EQ(got.extra.at("sampler").at("next").get<int>(), 32);
  EXPECT_EQ(got.state.adamw_step, st.adamw_step);
  EXPECT_DOUBLE_EQ(got.read_amplification, 1.0);
  // Every parameter element (padding between parameters is not checkpointed: zeros both ways).
  for (const auto& p : a->layout().params)
    for (std::int64_t i = 0; i < p.numel; ++i) {
      const std::size_t k = static_cast<std::size_t>(p.offset + i);
      ASSERT_EQ(got.state.params[k], st.params[k]) << p.name << "[" << i << "]";
      ASSERT_EQ(got.state.adam_m[k], st.adam_m[k]) << p.name;
      ASSERT_EQ(got.state.adam_v[k], st.adam_v[k]) << p.name;
    }
  EXPECT_EQ(got.state.router_bias, st.router_bias);
  // The restored state trains on exactly as the original.
  b->set_state(got.state);
  std::vector<std::uint32_t> tok(16, 3);
  std::vector<std::int32_t> tgt(16, 5);
  b->zero_grads();
  a->zero_grads();
  EXPECT_EQ(b->forward(tok.data(), tgt.data()).total, a->forward(tok.data(), tgt.data()).total);
}

// The adam balancing controller's moments (the pid rule's last errors) and update count are
// train state: saved, restored with the rule that wrote them, and the restored controller moves
// the biases exactly as the original. A run saved under another rule has none, and loads with
// empty moments.
class BalanceMemoryRoundTrip : public ::testing::TestWithParam<ops::bias_controller::Rule> {};

TEST_P(BalanceMemoryRoundTrip, SavedRestoredAndContinued) {
  const ops::bias_controller::Rule rule = GetParam();
  // a directory per rule: ctest runs the two instances at once
  const std::string tag = rule == ops::bias_controller::Rule::Adam ? "adam" : "pid";
  const fs::path root = fresh_dir("balance_" + tag);
  auto a = trained(tiny(), rule);
  const TrainState st = a->state();
  ASSERT_EQ(st.router_balance.m.size(), st.router_bias.size());
  EXPECT_EQ(st.router_balance.updates, 2);
  bool moved = false;
  for (const auto& m : st.router_balance.m)
    for (float x : m) moved |= x != 0.f;
  EXPECT_TRUE(moved);
  {
    TrainCheckpointer ck(root.string(), {});
    ck.save(2, st, a->layout(), nlohmann::json::object());
    ck.finish();
  }
  const LoadedTrainState got = load_train_checkpoint(root.string(), tiny());
  EXPECT_EQ(got.state.router_balance.m, st.router_balance.m);
  EXPECT_EQ(got.state.router_balance.v, st.router_balance.v);
  EXPECT_EQ(got.state.router_balance.updates, 2);
  EXPECT_EQ(got.state.router_balance.rule, rule);
  auto b = make_cpu_backend(tiny(), options(rule), {}, parallel::Mesh());
  b->set_state(got.state);
  std::vector<std::uint32_t> tok(16);
  std::vector<std::int32_t> tgt(16);
  for (int i = 0; i < 16; ++i) tok[i] = (i * 3) % tiny().vocab_size, tgt[i] = (i * 11 + 1) % tiny().vocab_size;
  for (auto* x : {a.get(), b.get()}) {
    x->zero_grads();
    x->forward(tok.data(), tgt.data());
    x->update_router_bias();
  }
  EXPECT_EQ(a->state().router_bias, b->state().router_bias);
  EXPECT_EQ(a->state().router_balance.m, b->state().router_balance.m);
  EXPECT_EQ(a->state().router_balance.v, b->state().router_balance.v);
  // Resumed under the other rule, the memory is not reused: it starts again at zero, as
  // update_balancing_bias does on a first update.
  const ops::bias_controller::Rule other =
      rule == ops::bias_controller::Rule::Adam ? ops::bias_controller::Rule::Pid : ops::bias_controller::Rule::Adam;
  auto c = make_cpu_backend(tiny(), options(other), {}, parallel::Mesh());
  auto fresh = make_cpu_backend(tiny(), options(other), {}, parallel::Mesh());
  TrainState no_memory = got.state;
  no_memory.router_balance = {};
  c->set_state(got.state);
  fresh->set_state(no_memory);
  for (auto* x : {c.get(), fresh.get()}) {
    x->zero_grads();
    x->forward(tok.data(), tgt.data());
    x->update_router_bias();
  }
  EXPECT_EQ(c->state().router_bias, fresh->state().router_bias);
  EXPECT_EQ(c->state().router_balance.m, fresh->state().router_balance.m);
  EXPECT_EQ(c->state().router_balance.rule, other);

  const fs::path sign_root = fresh_dir("balance_sign_" + tag);
  {
    auto c = trained(tiny());
    EXPECT_TRUE(c->state().router_balance.m.empty());
    TrainCheckpointer ck(sign_root.string(), {});
    ck.save(2, c->state(), c->layout(), nlohmann::json::object());
    ck.finish();
  }
  EXPECT_TRUE(load_train_checkpoint(sign_root.string(), tiny()).state.router_balance.m.empty());
}

INSTANTIATE_TEST_SUITE_P(Rules, BalanceMemoryRoundTrip,
                         ::testing::Values(ops::bias_controller::Rule::Adam, ops::bias_controller::Rule::Pid),
                         [](const auto& info) {
                           return info.param == ops::bias_controller::Rule::Adam ? std::string("Adam") : std::string("Pid");
                         });

TEST(TrainCheckpoint, WrongModelOrFileIsAClearError) {
  const fs::path root = fresh_dir("wrong");
  auto a = trained(tiny());
  {
    TrainCheckpointer ck(root.string(), {});
    ck.save(2, a->state(), a->layout(), nlohmann::json::object());
    ck.finish();
  }
  // Another model (8 experts): the expert tensors' shapes differ; the error names one.
  try {
    load_train_checkpoint(root.string(), tiny(8));
    FAIL() << "loaded a checkpoint of another model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.1.moe."), std::string::npos) << e.what();
  }
  // A smaller model of the same shapes (1 of the 2 layers): every tensor it asks for is there,
  // but layer 1 would be silently dropped; the weights-only load names the first unused tensor.
  model::ModelConfig fewer_layers = tiny();
  fewer_layers.layers = 1;
  try {
    load_model_weights(root.string(), fewer_layers);
    FAIL() << "loaded a 2-layer checkpoint into a 1-layer model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor model/layers.1."), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("has no place in model 'ckpt-tiny' (1 layers)"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(load_model_weights(root.string(), tiny()));
  // Not a checkpoint at all.
  EXPECT_FALSE(is_ckpt_directory((root / "nope").string()));
  EXPECT_THROW(load_train_checkpoint((root / "nope").string(), tiny()), Error);
}

// ---- tensor parallelism ----

// tiny() with a vocabulary that splits over 2 and 4 tensor ranks (kv heads 2: replicated at 4).
model::ModelConfig tp_tiny() {
  model::ModelConfig m = tiny();
  m.name = "ckpt-tp";
  m.vocab_size = 32;
  return m;
}

// ZAYA1's layers: CCA (fused [q; k] tensors split by parts), MLP router with a skip class.
model::ModelConfig tp_cca() {
  model::ModelConfig m = tp_tiny();
  m.name = "ckpt-tp-cca";
  m.heads = 8, m.kv_heads = 4, m.head_dim = 4;
  m.attention = model::AttentionKind::kCca;
  m.cca_q_dim = 32, m.cca_k_dim = 16, m.cca_v_dim = 16, m.cca_conv_width = 2, m.cca_group_conv_width = 2;
  m.router_hidden = 8;
  m.router_mlp_layers = 3;
  m.router_skip_expert = true;
  m.top_k = 1;
  m.residual_scaling = true;
  return m;
}

mesh::Shape mesh_of(int dp, int tp, int ep = 1) {
  mesh::Shape m;
  m.dp = dp;
  m.tp = tp;
  m.ep = ep;
  return m;
}

const optim::ParamInfo& param(const optim::ParamLayout& l, const std::string& name) {
  for (const auto& p : l.params)
    if (p.name == name) return p;
  throw Error("no parameter " + name);
}

// The moments a simulated rank holds: functions of the parameter, so every layout knows them.
float m_of(float p) { return 0.5f * p + 0.25f; }
float v_of(float p) { return p * p + 1.0f; }

// Rank `rank` of mesh `m`: its parameters as init_parameters makes them, its slice (its ZeRO-1
// shards: plan_state_shards), moments m_of / v_of of its parameters, fixed router biases.
struct SimRank {
  optim::ParamLayout layout;
  TrainState state;
};
SimRank sim_rank(const model::ModelConfig& cfg, const mesh::Shape& m, int rank) {
  SimRank r;
  r.layout = model::param_layout(cfg, m);
  const mesh::Coord at = m.coord(rank);
  TrainState& st = r.state;
  st.params.resize(static_cast<std::size_t>(r.layout.total_floats));
  model::init_parameters(cfg, r.layout, 0.02, 99, st.params.data(), m, at);
  st.set_slice(plan_state_shards(r.layout, m, at).slice);
  EXPECT_EQ(st.tensor_parallel, m.tp);
  EXPECT_EQ(st.tensor_rank, at.tp);
  const StateSlice sl = st.slice();
  st.adam_m.resize(static_cast<std::size_t>(sl.moments()));
  st.adam_v.resize(st.adam_m.size());
  for (const MomentRange& mr : moment_ranges(sl))
    for (std::int64_t k = mr.begin; k < mr.end; ++k) {
      const float p = st.params[static_cast<std::size_t>(k)];
      st.adam_m[static_cast<std::size_t>(mr.at + k - mr.begin)] = m_of(p);
      st.adam_v[static_cast<std::size_t>(mr.at + k - mr.begin)] = v_of(p);
    }
  const std::size_t classes = static_cast<std::size_t>(cfg.experts + (cfg.router_skip_expert ? 1 : 0));
  for (int i = 0; i < model::moe_layer_count(cfg); ++i) {
    st.router_bias.emplace_back(classes);
    for (std::size_t j = 0; j < classes; ++j) st.router_bias.back()[j] = static_cast<float>(10 * i + j) / 8;
  }
  st.adamw_step = 7;
  return r;
}

// The whole model's parameters (T = 1): what every element of every layout must equal.
struct Whole {
  optim::ParamLayout layout;
  std::vector<float> params;
  explicit Whole(const model::ModelConfig& cfg) : layout(model::param_layout(cfg)) {
    params.resize(static_cast<std::size_t>(layout.total_floats));
    model::init_parameters(cfg, layout, 0.02, 99, params.data());
  }
  // Element `i` (row-major over `box`) of parameter `name`'s box.
  float at(const std::string& name, const ckpt::Box& box, std::int64_t i) const {
    const auto& p = param(layout, name);
    std::int64_t f = 0, rest = i;
    std::vector<std::int64_t> idx(box.ndim());
    for (std::size_t d = box.ndim(); d-- > 0;) idx[d] = box.offsets[d] + rest % box.lengths[d], rest /= box.lengths[d];
    for (std::size_t d = 0; d < idx.size(); ++d) f = f * p.global_shape[d] + idx[d];
    return params[static_cast<std::size_t>(p.offset + f)];
  }
};

TEST(TrainCheckpointTensorParallel, BlockBoxesOfInnerSplitsAndParts) {
  // Row-parallel wo [16, 16] at T = 2, rank 1 holds columns [8, 16) of every row: its local
  // elements [4, 20) are row 0's columns 4..8, row 1 and row 2's columns 0..4 of the block.
  const model::ModelConfig cfg = tp_tiny();
  StateSlice r1;
  r1.tensor_parallel = 2, r1.tensor_rank = 1;
  const auto layout = model::param_layout(cfg, slice_mesh(r1));
  const auto& wo = param(layout, "layers.0.attn.wo");
  ASSERT_EQ(wo.shape, (std::vector<std::int64_t>{16, 8}));
  EXPECT_EQ(block_boxes(wo, r1, 4, 20),
            (std::vector<ckpt::Box>{{{0, 12}, {1, 4}}, {{1, 8}, {1, 8}}, {{2, 8}, {1, 4}}}));
  // Whole rows of the block are still one box per row run: rows 2..4 whole.
  EXPECT_EQ(block_boxes(wo, r1, 16, 48), (std::vector<ckpt::Box>{{{2, 8}, {4, 8}}}));
  // Expert w_down [4, 16, 12] over ep = 2 (dim 0) and tp = 2 (dim 2): expert rank 1, tensor rank
  // 0 holds experts 2..4, columns 0..6.
  StateSlice x;
  x.expert_parallel = 2, x.expert_rank = 1, x.tensor_parallel = 2, x.tensor_rank = 0;
  const auto xl = model::param_layout(cfg, slice_mesh(x));
  const auto& down = param(xl, "layers.1.moe.w_down");
  ASSERT_EQ(down.shape, (std::vector<std::int64_t>{2, 16, 6}));
  EXPECT_EQ(block_boxes(down, x, 0, down.numel), (std::vector<ckpt::Box>{{{2, 0, 0}, {2, 16, 6}}}));
  // CCA's [q; k] (Q = 32, KV = 16) at T = 4, rank 3: local rows 0..8 are q rows 24..32, rows
  // 8..12 k rows 44..48. A range across the part boundary is cut there.
  const model::ModelConfig c = tp_cca();
  StateSlice t3;
  t3.tensor_parallel = 4, t3.tensor_rank = 3;
  const auto cl = model::param_layout(c, slice_mesh(t3));
  const auto& qk = param(cl, "layers.0.attn.cca.w_qk");
  ASSERT_EQ(qk.shape, (std::vector<std::int64_t>{12, 16}));
  EXPECT_EQ(block_boxes(qk, t3, 6 * 16 + 3, 10 * 16),
            (std::vector<ckpt::Box>{{{30, 3}, {1, 13}}, {{31, 0}, {1, 16}}, {{44, 0}, {2, 16}}}));
  EXPECT_THROW(block_boxes(qk, t3, 0, qk.numel + 1), Error);
  // Every local range of every parameter of every rank: boxes in flat order whose elements are
  // those of the block's pieces.
  for (const auto& [cf, sl] : std::vector<std::pair<model::ModelConfig, StateSlice>>{{cfg, r1}, {cfg, x}, {c, t3}}) {
    const auto l = model::param_layout(cf, slice_mesh(sl));
    for (const auto& p : l.params) {
      const auto pcs = model::block_pieces(p, slice_mesh(sl), slice_coord(sl));
      for (std::int64_t lo : {std::int64_t{0}, p.numel / 3, p.numel / 2 + 1})
        for (std::int64_t hi : {lo, p.numel - p.numel / 5, p.numel}) {
          if (hi < lo) continue;
          std::int64_t i = lo;
          for (const ckpt::Box& b : block_boxes(p, pcs, lo, hi)) {
            ASSERT_TRUE(ckpt::box_within(b, p.global_shape)) << p.name;
            for (std::int64_t k = 0; k < b.volume(); ++k, ++i) {
              // box element k in the whole tensor, and local element i through the pieces
              std::vector<std::int64_t> g(b.ndim()), li(p.shape.size());
              for (std::int64_t d = static_cast<std::int64_t>(b.ndim()) - 1, rest = k; d >= 0; --d)
                g[d] = b.offsets[d] + rest % b.lengths[d], rest /= b.lengths[d];
              for (std::int64_t d = static_cast<std::int64_t>(li.size()) - 1, rest = i; d >= 0; --d)
                li[d] = rest % p.shape[d], rest /= p.shape[d];
              bool found = false;
              for (const auto& pc : pcs)
                if (li[0] >= pc.local_row && li[0] < pc.local_row + pc.extent[0]) {
                  found = true;
                  ASSERT_EQ(g[0], pc.offset[0] + li[0] - pc.local_row) << p.name << " local " << i;
                  for (std::size_t d = 1; d < li.size(); ++d) ASSERT_EQ(g[d], pc.offset[d] + li[d]) << p.name;
                }
              ASSERT_TRUE(found) << p.name;
            }
          }
          ASSERT_EQ(i, hi) << p.name << " [" << lo << ", " << hi << ")";
        }
    }
  }
}

// Every rank of a mesh (its slice from plan_state_shards) lists its writes: over all ranks
// every element of every tensor is written exactly once (a replicated parameter by tensor rank 0
// alone), with the whole model's value.
TEST(TrainCheckpointTensorParallel, WritesOfAllRanksTileEveryTensorOnce) {
  for (const model::ModelConfig& cfg : {tp_tiny(), tp_cca()}) {
    const Whole whole(cfg);
    for (const mesh::Shape& m : {mesh_of(2, 1), mesh_of(1, 2), mesh_of(2, 2), mesh_of(2, 2, 2), mesh_of(1, 4),
                                 mesh_of(3, 4), mesh_of(2, 4, 2)}) {
      SCOPED_TRACE(cfg.name + " " + m.str());
      std::map<std::string, std::vector<ckpt::Box>> boxes;
      std::map<std::string, ckpt::Shape> shapes;
      for (int rank = 0; rank < m.world(); ++rank) {
        const SimRank r = sim_rank(cfg, m, rank);
        const CheckpointView view = CheckpointView::of(std::make_shared<const TrainState>(r.state));
        mesh::Shape named = m;
        named.zero = m.dp > 1 ? 1 : 0;
        EXPECT_EQ(checkpoint_layout_name(m.world(), view.slice), named.str());
        for (const ckpt::SaveShard& s : checkpoint_shards(view, r.layout, rank, m.world())) {
          ASSERT_TRUE(s.write);
          boxes[s.name].push_back(s.box);
          shapes[s.name] = s.shape;
          const float* d = static_cast<const float*>(s.data);
          if (s.name.starts_with("router/")) {
            ASSERT_EQ(std::vector<float>(d, d + s.box.volume()), r.state.router_bias[std::stoul(s.name.substr(12))]);
            continue;
          }
          const bool model = s.name.starts_with("model/"), sq = s.name.starts_with("optim/exp_avg_sq/");
          const std::string name = s.name.substr(model ? 6 : sq ? 17 : 14);
          for (std::int64_t i = 0; i < s.box.volume(); ++i) {
            const float w = whole.at(name, s.box, i);
            ASSERT_EQ(d[i], model ? w : sq ? v_of(w) : m_of(w)) << s.name << " " << ckpt::box_str(s.box) << " [" << i << "]";
          }
        }
      }
      std::set<std::string> expected;
      for (const auto& p : model::param_specs(cfg))
        for (const char* pre : {"model/", "optim/exp_avg/", "optim/exp_avg_sq/"}) expected.insert(pre + p.name);
      for (int i = 0; i < model::moe_layer_count(cfg); ++i) expected.insert("router/bias." + std::to_string(i));
      std::set<std::string> got;
      for (const auto& [name, b] : boxes) {
        got.insert(name);
        EXPECT_EQ(ckpt::coverage_problem(shapes[name], b), "") << name;
      }
      EXPECT_EQ(got, expected);
    }
  }
}

// Ranks of one process: gather and bcast through shared slots and a barrier.
struct ThreadWorld {
  explicit ThreadWorld(int n) : slots(static_cast<std::size_t>(n)), sync(n) {}
  std::vector<std::string> slots;
  std::string root;
  std::barrier<> sync;
};
class ThreadComm : public ckpt::Comm {
 public:
  ThreadComm(ThreadWorld& w, int rank) : w_(w), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(w_.slots.size()); }
  std::vector<std::string> gather(const std::string& mine) override {
    w_.slots[static_cast<std::size_t>(rank_)] = mine;
    w_.sync.arrive_and_wait();
    std::vector<std::string> out;
    if (rank_ == 0) out = w_.slots;
    w_.sync.arrive_and_wait();
    return out;
  }
  std::string bcast(const std::string& from_root) override {
    if (rank_ == 0) w_.root = from_root;
    w_.sync.arrive_and_wait();
    std::string out = w_.root;
    w_.sync.arrive_and_wait();
    return out;
  }

 private:
  ThreadWorld& w_;
  int rank_;
};

// Every rank of `m` saves its simulated state at step 3 (one thread each, TrainCheckpointer over
// a ThreadComm of the world); returns the committed step directory.
std::string save_with_threads(const model::ModelConfig& cfg, const mesh::Shape& m, const fs::path& root) {
  ThreadWorld world(m.world());
  std::vector<std::string> errors(static_cast<std::size_t>(m.world()));
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < m.world(); ++rank)
    ranks.emplace_back([&, rank] {
      try {
        const SimRank r = sim_rank(cfg, m, rank);
        TrainCheckpointer ck(root.string(), {}, std::make_unique<ThreadComm>(world, rank));
        ck.save(3, r.state, r.layout, {{"sampler", {{"next", 5}}}});
        ck.finish();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
        world.sync.arrive_and_drop();  // the others do not wait for this rank
      }
    });
  for (auto& t : ranks) t.join();
  for (int rank = 0; rank < m.world(); ++rank) EXPECT_EQ(errors[static_cast<std::size_t>(rank)], "") << "rank " << rank;
  return root.string();
}

// Every rank of `m` loads the checkpoint: its blocks of the parameters, the moments of its
// shards and the router biases equal the simulated state of that rank (what a run of `m` would
// have saved), and the weights-only load gives the same parameters.
void expect_loads_at(const model::ModelConfig& cfg, const std::string& dir, const mesh::Shape& m) {
  SCOPED_TRACE("loaded at " + m.str());
  for (int rank = 0; rank < m.world(); ++rank) {
    const SimRank want = sim_rank(cfg, m, rank);
    const StateSlice sl = want.state.slice();
    const LoadedTrainState got = load_train_checkpoint(dir, cfg, sl);
    EXPECT_EQ(got.step, 3);
    EXPECT_EQ(got.state.adamw_step, 7);
    EXPECT_EQ(got.state.tensor_parallel, m.tp);
    EXPECT_EQ(got.state.tensor_rank, sl.tensor_rank);
    EXPECT_EQ(got.state.router_bias, want.state.router_bias);
    ASSERT_EQ(got.state.params.size(), want.state.params.size());
    ASSERT_EQ(got.state.adam_m.size(), want.state.adam_m.size());
    const LoadedWeights w = load_model_weights(dir, cfg, sl.expert_parallel, sl.expert_rank, sl.tensor_parallel,
                                               sl.tensor_rank);
    EXPECT_EQ(w.state.tensor_rank, sl.tensor_rank);
    for (const auto& p : want.layout.params)  // padding between parameters is not stored
      for (std::int64_t k = p.offset; k < p.offset + p.numel; ++k) {
        const std::size_t u = static_cast<std::size_t>(k);
        ASSERT_EQ(got.state.params[u], want.state.params[u]) << "rank " << rank << " " << p.name << " at " << k;
        ASSERT_EQ(w.state.params[u], want.state.params[u]) << "rank " << rank << " " << p.name << " at " << k;
      }
    for (const MomentRange& r : moment_ranges(sl))
      for (const auto& p : want.layout.params)
        for (std::int64_t k = std::max(r.begin, p.offset); k < std::min(r.end, p.offset + p.numel); ++k) {
          const std::size_t u = static_cast<std::size_t>(r.at + k - r.begin);
          ASSERT_EQ(got.state.adam_m[u], want.state.adam_m[u]) << "rank " << rank << " " << p.name << " at " << k;
          ASSERT_EQ(got.state.adam_v[u], want.state.adam_v[u]) << "rank " << rank << " " << p.name << " at " << k;
        }
  }
}

TEST(TrainCheckpointTensorParallel, SavedAtOneTensorDegreeLoadsAtAnother) {
  struct Case {
    model::ModelConfig cfg;
    mesh::Shape saved;
    std::string layout;
  };
  for (const Case& c : {Case{tp_tiny(), mesh_of(1, 2), "dp=1,tp=2"}, Case{tp_tiny(), mesh_of(2, 2, 2), "dp=2,tp=2,ep=2,zero=1"},
                        Case{tp_cca(), mesh_of(2, 2), "dp=2,tp=2,zero=1"}}) {
    SCOPED_TRACE(c.cfg.name + " saved at " + c.saved.str());
    const fs::path root = fresh_dir("tp_" + c.cfg.name + "_" + std::to_string(c.saved.world()) + "_" +
                                    std::to_string(c.saved.ep));
    const std::string dir = save_with_threads(c.cfg, c.saved, root);
    const ckpt::Reader reader(dir);
    EXPECT_EQ(reader.metadata().layout, c.layout);
    EXPECT_EQ(reader.metadata().world, c.saved.world());
    for (const mesh::Shape& m : {mesh_of(1, 1), mesh_of(3, 1), mesh_of(1, 4), mesh_of(2, 4, 2), mesh_of(2, 2),
                                 mesh_of(2, 1, 2)})
      expect_loads_at(c.cfg, dir, m);
  }
}

TEST(TrainCheckpointTensorParallel, TensorRanksNeedTheWorldCommunicator) {
  // A tensor rank's state saved by a checkpointer of one rank: its tensor group is missing.
  const SimRank r = sim_rank(tp_tiny(), mesh_of(1, 2), 1);
  TrainCheckpointer ck(fresh_dir("tp_alone").string(), {});
  try {
    ck.save(1, r.state, r.layout, nlohmann::json::object());
    FAIL() << "saved tensor rank 1 of 2 alone";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 saving ranks are not whole tensor x context groups of 2"), std::string::npos)
        << e.what();
  }
  // Context parallelism splits no tensor: it is named in the layout, and a world that is not
  // whole tensor x context groups is refused.
  StateSlice tp2;
  tp2.tensor_parallel = 2;
  EXPECT_EQ(checkpoint_layout_name(8, tp2, 2), "dp=2,cp=2,tp=2,zero=1");
  EXPECT_EQ(checkpoint_layout_name(2, StateSlice{}, 2), "dp=1,cp=2,zero=1");
  EXPECT_THROW(checkpoint_layout_name(6, tp2, 2), Error);
  // A load for a tensor rank outside the degree.
  StateSlice bad;
  bad.tensor_parallel = 2, bad.tensor_rank = 2;
  EXPECT_THROW(load_train_checkpoint(fresh_dir("tp_none").string(), tp_tiny(), bad), Error);
}

}  // namespace
}  // namespace keel::train

// A rank's blocks of the parameters under tensor (and expert) parallelism: model::block_pieces
// maps every block onto the whole tensor (inner-dimension splits, CCA's parts), the blocks of
// all ranks tile each tensor exactly once, and init_parameters gives a rank's block exactly the
// values the same elements have in the whole model. The whole model's values are checked against
// a serial reference of the documented draw order; the blocks against explicit index arithmetic.
#include "model/param_layout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/error.h"

namespace keel::model {
namespace {

// Dense layer 0, MoE layer 1 (4 experts), untied head; vocab and widths divisible by 4.
ModelConfig gqa(int heads = 4, int kv_heads = 2) {
  ModelConfig m;
  m.name = "tp-gqa";
  m.vocab_size = 32;
  m.hidden = 16;
  m.layers = 2;
  m.attention = AttentionKind::kGqa;
  m.heads = heads;
  m.kv_heads = kv_heads;
  m.head_dim = 4;
  m.ffn_hidden = 24;
  m.experts = 4;
  m.top_k = 2;
  m.expert_hidden = 12;
  m.first_dense_layers = 1;
  m.tied_embeddings = false;
  m.rope_fraction = 1.0;
  m.max_seq_len = 32;
  return m;
}

ModelConfig mha() {
  ModelConfig m = gqa(4, 4);
  m.name = "tp-mha";
  m.attention = AttentionKind::kMha;
  return m;
}

// ZAYA1's layers (CCA with its fused [q; k] tensors, MLP router with a skip class, residual
// scales), 8 q heads and 4 kv heads of 4: Q = 32, KV = 16.
ModelConfig cca() {
  ModelConfig m = gqa(8, 4);
  m.name = "tp-cca";
  m.attention = AttentionKind::kCca;
  m.cca_q_dim = 32, m.cca_k_dim = 16, m.cca_v_dim = 16, m.cca_conv_width = 2, m.cca_group_conv_width = 2;
  m.router_hidden = 8;
  m.router_mlp_layers = 3;
  m.router_skip_expert = true;
  m.top_k = 1;
  m.residual_scaling = true;
  m.tied_embeddings = true;
  return m;
}

std::vector<ModelConfig> configs() { return {gqa(), mha(), cca()}; }

mesh::Shape mesh_of(int tp, int ep) {
  mesh::Shape m;
  m.tp = tp;
  m.dp = m.ep = ep;
  return m;
}

mesh::Coord coord_of(int t, int e) {
  mesh::Coord at;
  at.tp = t;
  at.dp = at.ep = e;
  return at;
}

std::vector<float> init(const ModelConfig& cfg, const optim::ParamLayout& layout, const mesh::Shape& m = {},
                        const mesh::Coord& at = {}) {
  std::vector<float> v(static_cast<std::size_t>(layout.total_floats));
  init_parameters(cfg, layout, 0.02, 1234, v.data(), m, at);
  return v;
}

const optim::ParamInfo& find(const optim::ParamLayout& l, const std::string& name) {
  for (const auto& p : l.params)
    if (p.name == name) return p;
  throw Error("no parameter " + name);
}

std::int64_t flat(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& idx) {
  std::int64_t f = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

// Row-major multi-index of flat index i of `shape`.
std::vector<std::int64_t> unflat(const std::vector<std::int64_t>& shape, std::int64_t i) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) idx[d] = i % shape[d], i /= shape[d];
  return idx;
}

// The whole tensor's flat index of local element i of p's block, through its pieces.
std::int64_t global_of(const optim::ParamInfo& p, const std::vector<BlockPiece>& pieces, std::int64_t i) {
  std::vector<std::int64_t> idx = unflat(p.shape, i);
  for (const BlockPiece& pc : pieces)
    if (idx[0] >= pc.local_row && idx[0] < pc.local_row + pc.extent[0]) {
      std::vector<std::int64_t> g(idx.size());
      g[0] = pc.offset[0] + idx[0] - pc.local_row;
      for (std::size_t d = 1; d < idx.size(); ++d) g[d] = pc.offset[d] + idx[d];
      for (std::size_t d = 0; d < g.size(); ++d)
        if (g[d] < 0 || g[d] >= p.global_shape[d]) {
          ADD_FAILURE() << p.name << ": local element " << i << " maps outside the tensor (dimension " << d << ")";
          return -1;
        }
      return flat(p.global_shape, g);
    }
  ADD_FAILURE() << p.name << ": local row " << idx[0] << " is in no piece";
  return -1;
}

// The documented draw order, serially: one splitmix64 stream over the whole model's matrices in
// param_specs order, element e of a matrix from the two draws at first_draw + 2 e (Box-Muller).
std::map<std::string, std::vector<float>> reference_matrices(const ModelConfig& cfg, double std, std::uint64_t seed) {
  std::uint64_t s = seed;
  auto next = [&] {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  auto uniform = [&] { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); };
  std::map<std::string, std::vector<float>> out;
  const double out_scale = 1.0 / std::sqrt(2.0 * cfg.layers);
  for (const auto& p : param_specs(cfg)) {
    if (p.shape.size() <= 1) continue;
    std::int64_t n = 1;
    for (auto d : p.shape) n *= d;
    const bool out_proj = p.name.ends_with(".wo") || p.name.ends_with("w_down");
    auto& v = out[p.name];
    for (std::int64_t i = 0; i < n; ++i) {
      const double u1 = uniform(), u2 = uniform();
      v.push_back(static_cast<float>(std * (out_proj ? out_scale : 1.0) *
                                     (std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2))));
    }
  }
  return out;
}

TEST(ParamLayout, WholeModelInitFollowsTheDrawOrder) {
  for (const ModelConfig& cfg : configs()) {
    SCOPED_TRACE(cfg.name);
    const auto layout = param_layout(cfg);
    const auto got = init(cfg, layout);
    const auto ref = reference_matrices(cfg, 0.02, 1234);
    for (const auto& p : layout.params) {
      if (p.ndim() == 1) continue;
      const auto& r = ref.at(p.name);
      ASSERT_EQ(static_cast<std::int64_t>(r.size()), p.numel) << p.name;
      for (std::int64_t i = 0; i < p.numel; ++i)
        ASSERT_EQ(got[static_cast<std::size_t>(p.offset + i)], r[static_cast<std::size_t>(i)]) << p.name << "[" << i << "]";
    }
  }
}

TEST(ParamLayout, PiecesOfRowAndColumnParallelAndPartsTensors) {
  const ModelConfig g = gqa(), c = cca();
  const std::int64_t D = 16, Q = 32, KV = 16, E = 4, F = 12;
  // Row-parallel wo [D, Q] of the gqa model (Q = 16 there) at T = 2, rank 1: columns [8, 16).
  {
    const auto layout = param_layout(g, mesh_of(2, 1));
    const auto pcs = block_pieces(find(layout, "layers.0.attn.wo"), mesh_of(2, 1), coord_of(1, 0));
    ASSERT_EQ(pcs.size(), 1u);
    EXPECT_EQ(pcs[0].offset, (std::vector<std::int64_t>{0, 8}));
    EXPECT_EQ(pcs[0].extent, (std::vector<std::int64_t>{D, 8}));
    EXPECT_EQ(pcs[0].local_row, 0);
  }
  // CCA's [q; k] at T = 4, rank 2: q rows [16, 24), then k rows Q + [8, 12).
  {
    const auto layout = param_layout(c, mesh_of(4, 1));
    for (const char* name : {"layers.0.attn.cca.w_qk", "layers.0.attn.cca.conv1.weight", "layers.1.attn.cca.conv0.bias"}) {
      SCOPED_TRACE(name);
      const auto& p = find(layout, name);
      const auto pcs = block_pieces(p, mesh_of(4, 1), coord_of(2, 0));
      ASSERT_EQ(pcs.size(), 2u);
      EXPECT_EQ(pcs[0].offset[0], 2 * Q / 4);
      EXPECT_EQ(pcs[0].extent[0], Q / 4);
      EXPECT_EQ(pcs[0].local_row, 0);
      EXPECT_EQ(pcs[1].offset[0], Q + 2 * KV / 4);
      EXPECT_EQ(pcs[1].extent[0], KV / 4);
      EXPECT_EQ(pcs[1].local_row, Q / 4);
      for (std::size_t d = 1; d < p.shape.size(); ++d) EXPECT_EQ(pcs[1].extent[d], p.global_shape[d]);
    }
    // Not split (T = 1): the parts are one piece, the whole tensor.
    const auto whole = param_layout(c);
    const auto pcs = block_pieces(find(whole, "layers.0.attn.cca.w_qk"), {}, {});
    ASSERT_EQ(pcs.size(), 1u);
    EXPECT_EQ(pcs[0].extent, (std::vector<std::int64_t>{Q + KV, D}));
  }
  // Experts over ep and tp: w_gate [E, F, D] (dims 0 and 1), w_down [E, D, F] (dims 0 and 2).
  {
    const auto layout = param_layout(g, mesh_of(2, 2));
    const auto gate = block_pieces(find(layout, "layers.1.moe.w_gate"), mesh_of(2, 2), coord_of(1, 1));
    ASSERT_EQ(gate.size(), 1u);
    EXPECT_EQ(gate[0].offset, (std::vector<std::int64_t>{E / 2, F / 2, 0}));
    EXPECT_EQ(gate[0].extent, (std::vector<std::int64_t>{E / 2, F / 2, D}));
    const auto down = block_pieces(find(layout, "layers.1.moe.w_down"), mesh_of(2, 2), coord_of(1, 0));
    ASSERT_EQ(down.size(), 1u);
    EXPECT_EQ(down[0].offset, (std::vector<std::int64_t>{0, 0, F / 2}));
    EXPECT_EQ(down[0].extent, (std::vector<std::int64_t>{E / 2, D, F / 2}));
  }
}

TEST(ParamLayout, BlockStartOnlyForOneRunAndPiecesOfAnotherMeshAreRefused) {
  const ModelConfig g = gqa();
  const auto ep2 = param_layout(g, mesh_of(1, 2));
  // The expert stacks over ep alone are one run: expert rank 1 starts at expert 2.
  EXPECT_EQ(block_start(find(ep2, "layers.1.moe.w_down"), mesh_of(1, 2), coord_of(0, 1)), 2 * 16 * 12);
  EXPECT_EQ(block_start(find(ep2, "layers.0.attn.wo"), mesh_of(1, 2), coord_of(0, 1)), 0);
  const auto tp2 = param_layout(g, mesh_of(2, 1));
  // Column-parallel wq [Q, D] by rows: one run; row-parallel wo is not.
  EXPECT_EQ(block_start(find(tp2, "layers.0.attn.wq"), mesh_of(2, 1), coord_of(1, 0)), 8 * 16);
  EXPECT_THROW(block_start(find(tp2, "layers.0.attn.wo"), mesh_of(2, 1), coord_of(1, 0)), Error);
  EXPECT_THROW(block_start(find(param_layout(cca(), mesh_of(2, 1)), "layers.0.attn.cca.w_qk"), mesh_of(2, 1),
                           coord_of(0, 0)),
               Error);
  // A block laid out for T = 2 asked for at T = 4.
  EXPECT_THROW(block_pieces(find(tp2, "layers.0.attn.wo"), mesh_of(4, 1), coord_of(0, 0)), Error);
}

// The pieces of all ranks of a mesh tile every tensor: each element once per rank that holds
// it (tp x ep ranks, a tensor not split over an axis held by each of its ranks), and a block's
// pieces cover the block exactly.
TEST(ParamLayout, BlocksOfAllRanksTileEveryTensor) {
  for (const ModelConfig& cfg : configs())
    for (int tp : {1, 2, 4})
      for (int ep : {1, 2}) {
        SCOPED_TRACE(cfg.name + " tp=" + std::to_string(tp) + " ep=" + std::to_string(ep));
        const mesh::Shape m = mesh_of(tp, ep);
        const auto layout = param_layout(cfg, m);
        int split_tp = 0;
        for (const auto& p : layout.params) {
          const bool over_tp = p.placement.splits(mesh::Axis::kTensor), over_ep = p.placement.splits(mesh::Axis::kExpert);
          split_tp += over_tp && tp > 1;
          const int copies = (over_tp ? 1 : tp) * (over_ep ? 1 : ep);
          std::int64_t n = 1;
          for (auto d : p.global_shape) n *= d;
          ASSERT_EQ(p.numel * (over_tp ? tp : 1) * (over_ep ? ep : 1), n) << p.name;
          std::vector<int> count(static_cast<std::size_t>(n), 0);
          for (int t = 0; t < tp; ++t)
            for (int e = 0; e < ep; ++e) {
              const auto pcs = block_pieces(p, m, coord_of(t, e));
              std::int64_t rows = 0;
              for (const auto& pc : pcs) {
                EXPECT_EQ(pc.local_row, rows) << p.name;
                rows += pc.extent[0];
                for (std::size_t d = 1; d < p.shape.size(); ++d) EXPECT_EQ(pc.extent[d], p.shape[d]) << p.name;
              }
              EXPECT_EQ(rows, p.shape[0]) << p.name;
              for (std::int64_t i = 0; i < p.numel; ++i) {
                const std::int64_t g = global_of(p, pcs, i);
                ASSERT_GE(g, 0) << p.name;
                ++count[static_cast<std::size_t>(g)];
              }
            }
          for (std::size_t k = 0; k < count.size(); ++k)
            ASSERT_EQ(count[k], copies) << p.name << " element " << k;
        }
        if (tp > 1) EXPECT_GT(split_tp, 8);  // the schema does split over tp
      }
}

// Whole-model value of the element of `name` at global index `g`.
float whole_at(const optim::ParamLayout& l, const std::vector<float>& v, const std::string& name,
               const std::vector<std::int64_t>& g) {
  const auto& p = find(l, name);
  return v[static_cast<std::size_t>(p.offset + flat(p.global_shape, g))];
}

TEST(ParamLayout, SplitInitEqualsTheWholeModelsElements) {
  for (const ModelConfig& cfg : configs()) {
    const auto whole_layout = param_layout(cfg);
    const auto whole = init(cfg, whole_layout);
    for (int tp : {2, 4})
      for (int ep : {1, 2}) {
        const mesh::Shape m = mesh_of(tp, ep);
        const auto layout = param_layout(cfg, m);
        for (int e = 0; e < ep; ++e)
          for (int t = 0; t < tp; ++t) {
            SCOPED_TRACE(cfg.name + " tp=" + std::to_string(tp) + " ep=" + std::to_string(ep) + " at tp " +
                         std::to_string(t) + " ep " + std::to_string(e));
            const mesh::Coord at = coord_of(t, e);
            const auto got = init(cfg, layout, m, at);
            // Through the block mapping: every element of every parameter.
            for (const auto& p : layout.params) {
              const auto& w = find(whole_layout, p.name);
              const auto pcs = block_pieces(p, m, at);
              for (std::int64_t i = 0; i < p.numel; ++i) {
                const std::int64_t g = global_of(p, pcs, i);
                ASSERT_GE(g, 0) << p.name;
                ASSERT_EQ(got[static_cast<std::size_t>(p.offset + i)], whole[static_cast<std::size_t>(w.offset + g)])
                    << p.name << " local " << i;
              }
            }
            // Independently, by index arithmetic.
            auto local_at = [&](const std::string& name, const std::vector<std::int64_t>& idx) {
              const auto& p = find(layout, name);
              return got[static_cast<std::size_t>(p.offset + flat(p.shape, idx))];
            };
            const std::int64_t D = cfg.hidden, V = cfg.vocab_size;
            const std::int64_t Q = std::int64_t(cfg.heads) * cfg.head_dim, KV = std::int64_t(cfg.kv_heads) * cfg.head_dim;
            const std::int64_t Ql = Q / tp, KVl = KV / tp, Vl = V / tp;
            for (std::int64_t r = 0; r < Vl; ++r)
              for (std::int64_t c = 0; c < D; ++c)
                ASSERT_EQ(local_at("embed.weight", {r, c}), whole_at(whole_layout, whole, "embed.weight", {t * Vl + r, c}));
            for (int l = 0; l < cfg.layers; ++l) {
              const std::string pre = "layers." + std::to_string(l) + ".";
              if (cfg.attention == AttentionKind::kCca) {
                const std::string wo = pre + "attn.cca.wo", qk = pre + "attn.cca.w_qk";
                for (std::int64_t r = 0; r < D; ++r)
                  for (std::int64_t c = 0; c < Ql; ++c)
                    ASSERT_EQ(local_at(wo, {r, c}), whole_at(whole_layout, whole, wo, {r, t * Ql + c})) << wo;
                for (std::int64_t r = 0; r < Ql + KVl; ++r) {
                  const std::int64_t g = r < Ql ? t * Ql + r : Q + t * KVl + (r - Ql);  // [q; k] parts
                  for (std::int64_t c = 0; c < D; ++c)
                    ASSERT_EQ(local_at(qk, {r, c}), whole_at(whole_layout, whole, qk, {g, c})) << qk << " row " << r;
                  const std::string conv1 = pre + "attn.cca.conv1.weight";
                  for (std::int64_t h = 0; h < cfg.head_dim; ++h)
                    for (std::int64_t w = 0; w < cfg.cca_group_conv_width; ++w)
                      ASSERT_EQ(local_at(conv1, {r, h, w}), whole_at(whole_layout, whole, conv1, {g, h, w})) << conv1;
                }
              } else {
                const std::string wo = pre + "attn.wo", wq = pre + "attn.wq", wk = pre + "attn.wk";
                for (std::int64_t r = 0; r < D; ++r)
                  for (std::int64_t c = 0; c < Ql; ++c)
                    ASSERT_EQ(local_at(wo, {r, c}), whole_at(whole_layout, whole, wo, {r, t * Ql + c})) << wo;
                for (std::int64_t r = 0; r < Ql; ++r)
                  for (std::int64_t c = 0; c < D; ++c)
                    ASSERT_EQ(local_at(wq, {r, c}), whole_at(whole_layout, whole, wq, {t * Ql + r, c})) << wq;
                // k: by heads, or whole on every rank when tp exceeds the kv heads.
                const bool repl = kv_replicated(cfg, m);
                EXPECT_EQ(repl, tp > cfg.kv_heads);
                const std::int64_t kl = repl ? KV : KVl, k0 = repl ? 0 : t * KVl;
                for (std::int64_t r = 0; r < kl; ++r)
                  for (std::int64_t c = 0; c < D; ++c)
                    ASSERT_EQ(local_at(wk, {r, c}), whole_at(whole_layout, whole, wk, {k0 + r, c})) << wk;
              }
              if (is_moe_layer(cfg, l)) {
                const std::int64_t El = cfg.experts / ep, Fl = cfg.expert_hidden / tp;
                const std::string gate = pre + "moe.w_gate", down = pre + "moe.w_down";
                for (std::int64_t x = 0; x < El; ++x)
                  for (std::int64_t f = 0; f < Fl; ++f)
                    for (std::int64_t d = 0; d < D; ++d) {
                      ASSERT_EQ(local_at(gate, {x, f, d}),
                                whole_at(whole_layout, whole, gate, {e * El + x, t * Fl + f, d})) << gate;
                      ASSERT_EQ(local_at(down, {x, d, f}),
                                whole_at(whole_layout, whole, down, {e * El + x, d, t * Fl + f})) << down;
                    }
              } else {
                const std::int64_t Fl = cfg.ffn_hidden / tp;
                const std::string down = pre + "mlp.w_down";
                for (std::int64_t d = 0; d < D; ++d)
                  for (std::int64_t f = 0; f < Fl; ++f)
                    ASSERT_EQ(local_at(down, {d, f}), whole_at(whole_layout, whole, down, {d, t * Fl + f})) << down;
              }
            }
          }
      }
  }
}

}  // namespace
}  // namespace keel::model

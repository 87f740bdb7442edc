#include "model/param_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "common/error.h"

namespace keel::model {
namespace {

// Deterministic normal draws (splitmix64 + Box-Muller), the same on every platform.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()); }
};

// The groups of AdamW-only training (optim::default_rules() without Muon): conv weights (CCA)
// are their own group; every 1-D tensor (norms, biases, residual scales, temperatures, the EDA
// scale) is a vector without weight decay.
std::vector<optim::GroupRule> adamw_rules() {
  std::vector<optim::GroupRule> r(4);
  r[0].group = "embeddings";
  r[0].include = "*embed*|*lm_head*";
  r[0].min_ndim = 2;
  r[1].group = "convs";
  r[1].include = "*conv*";
  r[1].exclude = "*embed*|*lm_head*";
  r[1].min_ndim = 2;
  r[2].group = "vectors";
  r[2].max_ndim = 1;
  r[2].weight_decay = false;
  r[3].group = "matrices";
  r[3].exclude = "*embed*|*lm_head*|*conv*";
  r[3].min_ndim = 2;
  return r;
}

struct Specs {
  std::vector<optim::ParamSpec> list;
  void add(std::string name, std::vector<std::int64_t> shape) {
    const int ndim = static_cast<int>(shape.size());
    list.push_back({std::move(name), shape, mesh::Placement::replicated(ndim), shape});
  }
  void add_split(std::string name, std::vector<std::int64_t> shape, int dim, mesh::Axis axis) {
    const int ndim = static_cast<int>(shape.size());
    add_placed(std::move(name), shape, mesh::Placement::split(ndim, dim, axis));
  }
  void add_placed(std::string name, std::vector<std::int64_t> shape, mesh::Placement placement) {
    list.push_back({std::move(name), shape, std::move(placement), shape});
  }
  void add_res_scale(const std::string& prefix, std::int64_t D, bool with_r) {
    add(prefix + "h_scale", {D});
    add(prefix + "h_bias", {D});
    if (!with_r) return;
    add(prefix + "r_scale", {D});
    add(prefix + "r_bias", {D});
  }
};

// The index of a rank's block along dimension d of placement p: its coordinates on the axes
// splitting d, outermost first; and how many blocks that dimension has.
std::pair<std::int64_t, std::int64_t> block_of(const mesh::Placement& p, std::size_t d, const mesh::Shape& mesh,
                                               const mesh::Coord& at) {
  std::int64_t idx = 0, count = 1;
  for (mesh::Axis a : p.dims[d]) {
    idx = idx * mesh.degree(a) + at.on(a);
    count *= mesh.degree(a);
  }
  return {idx, count};
}

}  // namespace

std::vector<optim::ParamSpec> param_specs(const ModelConfig& cfg) {
  constexpr mesh::Axis kTp = mesh::Axis::kTensor;
  const std::int64_t D = cfg.hidden, V = cfg.vocab_size, Dh = cfg.head_dim;
  const std::int64_t Q = std::int64_t(cfg.heads) * Dh, KV = std::int64_t(cfg.kv_heads) * Dh;
  const bool scaled = cfg.residual_scaling;
  Specs s;
  s.add_split("embed.weight", {V, D}, 0, kTp);  // vocabulary-parallel
  int moe_stage = 0;
  for (int l = 0; l < cfg.layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    // Layer 0's attention stage scales the embedding only (no residual yet).
    if (scaled) s.add_res_scale(p + "res_scale.attn.", D, l > 0);
    s.add(p + "attn_norm.weight", {D});
    if (layer_attention_kind(cfg, l) == AttentionKind::kCca) {
      const std::int64_t C = Q + KV, W0 = cfg.cca_conv_width, W1 = cfg.cca_group_conv_width;
      // The q and k channels of the fused tensors split by heads, each rank's q heads and k
      // heads together: parts {Q, KV}.
      s.add_placed(p + "attn.cca.w_qk", {C, D}, mesh::Placement::split_parts(2, {Q, KV}, kTp));  // [linear_q; linear_k]
      s.add_split(p + "attn.cca.w_v", {KV, D}, 0, kTp);  // [val_proj1; val_proj2]: the value heads
      s.add_placed(p + "attn.cca.conv0.weight", {C, W0}, mesh::Placement::split_parts(2, {Q, KV}, kTp));
      s.add_placed(p + "attn.cca.conv0.bias", {C}, mesh::Placement::split_parts(1, {Q, KV}, kTp));
      s.add_placed(p + "attn.cca.conv1.weight", {C, Dh, W1}, mesh::Placement::split_parts(3, {Q, KV}, kTp));
      s.add_placed(p + "attn.cca.conv1.bias", {C}, mesh::Placement::split_parts(1, {Q, KV}, kTp));
      s.add_split(p + "attn.cca.temp", {cfg.kv_heads}, 0, kTp);
      s.add_split(p + "attn.cca.wo", {D, Q}, 1, kTp);  // row-parallel
    } else {
      s.add_split(p + "attn.wq", {Q, D}, 0, kTp);  // column-parallel by heads
      s.add_split(p + "attn.wk", {KV, D}, 0, kTp);  // (replicated when tp exceeds the kv heads: param_layout)
      s.add_split(p + "attn.wv", {KV, D}, 0, kTp);
      s.add_split(p + "attn.wo", {D, Q}, 1, kTp);  // row-parallel
    }
    if (scaled) s.add_res_scale(p + "res_scale.mlp.", D, true);
    s.add(p + "mlp_norm.weight", {D});
    if (is_moe_layer(cfg, l)) {
      const std::int64_t E = cfg.experts, F = cfg.expert_hidden;
      if (cfg.router_hidden > 0) {
        const std::int64_t R = cfg.router_hidden, classes = E + (cfg.router_skip_expert ? 1 : 0);
        s.add(p + "moe.router.down.weight", {R, D});
        s.add(p + "moe.router.down.bias", {R});
        if (moe_stage > 0) s.add(p + "moe.router.eda_scale", {R});  // no EDA on the first MoE stage
        s.add(p + "moe.router.norm.weight", {R});
        s.add(p + "moe.router.mlp1.weight", {R, R});
        s.add(p + "moe.router.mlp1.bias", {R});
        s.add(p + "moe.router.mlp2.weight", {R, R});
        s.add(p + "moe.router.mlp2.bias", {R});
        s.add(p + "moe.router.out.weight", {classes, R});
      } else {
        s.add(p + "moe.router", {E, D});
      }
      ++moe_stage;
      // Experts over ep, and each expert tensor-parallel (column-parallel gate and up,
      // row-parallel down) over tp.
      const auto expert = [&](int tp_dim) {
        mesh::Placement pl = mesh::Placement::split(3, 0, mesh::Axis::kExpert);
        pl.dims[static_cast<std::size_t>(tp_dim)].push_back(kTp);
        return pl;
      };
      s.add_placed(p + "moe.w_gate", {E, F, D}, expert(1));
      s.add_placed(p + "moe.w_up", {E, F, D}, expert(1));
      s.add_placed(p + "moe.w_down", {E, D, F}, expert(2));
    } else {
      const std::int64_t F = cfg.ffn_hidden;
      if (F <= 0) throw UsageError(fmt::format("model '{}': dense layer {} needs ffn_hidden > 0", cfg.name, l));
      s.add_split(p + "mlp.w_gate", {F, D}, 0, kTp);  // column-parallel
      s.add_split(p + "mlp.w_up", {F, D}, 0, kTp);
      s.add_split(p + "mlp.w_down", {D, F}, 1, kTp);  // row-parallel
    }
  }
  if (scaled) s.add_res_scale("final_res_scale.", D, true);
  s.add("final_norm.weight", {D});
  if (!cfg.tied_embeddings) s.add_split("lm_head.weight", {V, D}, 0, kTp);  // vocabulary-parallel
  return std::move(s.list);
}

mesh::Shape weight_shape(const mesh::Shape& s) {
  mesh::Shape w = s;
  w.tp = s.tp * s.tsp;
  w.tsp = 1;
  return w;
}

mesh::Coord weight_coord(const mesh::Shape& s, const mesh::Coord& at) {
  mesh::Coord w = at;
  w.tp = at.tsp * s.tp + at.tp;
  w.tsp = 0;
  return w;
}

bool kv_replicated(const ModelConfig& cfg, const mesh::Shape& mesh) { return mesh.tp * mesh.tsp > cfg.kv_heads; }

optim::ParamLayout param_layout(const ModelConfig& cfg, const mesh::Shape& given) {
  const mesh::Shape mesh = weight_shape(given);
  if (mesh.ep > 1 && (cfg.experts < 1 || cfg.experts % mesh.ep != 0))
    throw UsageError(fmt::format("model '{}': {} experts do not split over expert-parallel degree {}", cfg.name,
                                 cfg.experts, mesh.ep));
  std::vector<optim::ParamSpec> specs = param_specs(cfg);
  for (auto& p : specs) {
    // More tensor ranks than kv heads (mha / gqa): every rank holds all kv heads (as Megatron
    // replicates them) and its query heads read theirs (blocks/shape.h: AttnShape::kv_head0).
    if (kv_replicated(cfg, mesh) && (p.name.ends_with(".attn.wk") || p.name.ends_with(".attn.wv")))
      p.placement = mesh::Placement::replicated(static_cast<int>(p.shape.size()));
    // CCA likewise: its projections, convolutions and temperatures whole on every rank (the k
    // mixing averages a kv group's query heads, which then span ranks); each rank attends its
    // own query heads (ops/cca.h: Config::attend_q) and W_o stays split by them.
    if (kv_replicated(cfg, mesh) && p.name.find(".attn.cca.") != std::string::npos && !p.name.ends_with(".attn.cca.wo"))
      p.placement = mesh::Placement::replicated(static_cast<int>(p.shape.size()));
    for (std::size_t d = 0; d < p.shape.size(); ++d) {
      std::int64_t split = 1;
      for (mesh::Axis a : p.placement.dims[d]) split *= mesh.degree(a);
      bool parts_split = true;
      if (d == 0)
        for (std::int64_t part : p.placement.parts) parts_split = parts_split && part % split == 0;
      if (p.shape[d] % split != 0 || !parts_split)
        throw UsageError(fmt::format("model '{}': dimension {} ({}) of '{}' does not split over {} ranks ({})", cfg.name,
                                     d, p.shape[d], p.name, split, mesh.str()));
      p.shape[d] /= split;
    }
  }
  if (mesh.ep > 1)
    // This rank's E / ep experts, after every replicated parameter: the expert region's
    // gradients reduce over another group (docs/parallel.md).
    std::stable_partition(specs.begin(), specs.end(),
                          [](const optim::ParamSpec& p) { return !p.placement.splits(mesh::Axis::kExpert); });
  return optim::assign_groups(specs, adamw_rules());
}

optim::ParamLayout param_layout(const ModelConfig& cfg, int expert_parallel) {
  if (expert_parallel < 1)
    throw UsageError(fmt::format("model '{}': expert-parallel degree {} (must be >= 1)", cfg.name, expert_parallel));
  mesh::Shape m;
  m.dp = m.ep = expert_parallel;
  return param_layout(cfg, m);
}

std::int64_t global_param_count(const optim::ParamLayout& layout) {
  std::int64_t n = 0;
  for (const auto& p : layout.params) {
    std::int64_t g = 1;
    for (auto d : p.global_shape) g *= d;
    n += g;
  }
  return n;
}

std::vector<BlockPiece> block_pieces(const optim::ParamInfo& p, const mesh::Shape& mesh, const mesh::Coord& at) {
  const std::size_t nd = p.global_shape.size();
  if (p.shape.size() != nd || p.placement.dims.size() > nd)
    fail("parameter '{}': block of {} dimensions, whole tensor of {}, placement of {}", p.name, p.shape.size(), nd,
         p.placement.dims.size());
  BlockPiece base;
  base.offset.assign(nd, 0);
  base.extent = p.global_shape;
  const auto split = [&](std::size_t d) -> std::pair<std::int64_t, std::int64_t> {
    if (d >= p.placement.dims.size()) return {0, 1};
    return block_of(p.placement, d, mesh, at);
  };
  for (std::size_t d = 1; d < nd; ++d) {
    const auto [idx, count] = split(d);
    if (p.global_shape[d] % count != 0 || p.global_shape[d] / count != p.shape[d])
      fail("parameter '{}': dimension {} ({}) over {} ranks is not the block's {}", p.name, d, p.global_shape[d], count,
           p.shape[d]);
    base.extent[d] = p.global_shape[d] / count;
    base.offset[d] = idx * base.extent[d];
  }
  if (nd == 0) return {base};
  const auto [idx, count] = split(0);
  std::vector<std::int64_t> parts = p.placement.parts;
  if (parts.empty()) parts.push_back(p.global_shape[0]);
  std::int64_t part_start = 0, rows = 0;
  std::vector<BlockPiece> out;
  for (std::int64_t part : parts) {
    if (part < 0 || part % count != 0)
      fail("parameter '{}': part of {} rows of dimension 0 does not split over {} ranks", p.name, part, count);
    const std::int64_t n = part / count, first = part_start + idx * n;
    part_start += part;
    if (n == 0) continue;
    if (!out.empty() && out.back().offset[0] + out.back().extent[0] == first) {
      out.back().extent[0] += n;  // adjacent in the whole tensor as in the block: one piece
    } else {
      BlockPiece piece = base;
      piece.offset[0] = first;
      piece.extent[0] = n;
      piece.local_row = rows;
      out.push_back(std::move(piece));
    }
    rows += n;
  }
  if (part_start != p.global_shape[0] || rows != p.shape[0])
    fail("parameter '{}': parts of {} rows in all ({} of them here) for dimension 0 of {} (block {})", p.name,
         part_start, rows, p.global_shape[0], p.shape[0]);
  return out;
}

std::int64_t block_start(const optim::ParamInfo& p, const mesh::Shape& mesh, const mesh::Coord& at) {
  const std::vector<BlockPiece> pieces = block_pieces(p, mesh, at);
  const std::size_t nd = p.global_shape.size();
  if (pieces.empty()) return 0;  // an empty tensor
  const BlockPiece& b = pieces.front();
  // One run of the whole tensor: one piece whose dimensions are 1 before some dimension j and
  // whole after it.
  std::size_t j = 0;
  while (j + 1 < nd && b.extent[j] == 1) ++j;
  bool run = pieces.size() == 1;
  for (std::size_t d = j + 1; d < nd; ++d) run = run && b.extent[d] == p.global_shape[d];
  if (!run) fail("parameter '{}': its block is not one run of the tensor (an inner dimension or parts split)", p.name);
  std::int64_t start = 0;
  for (std::size_t d = 0; d < nd; ++d) start = start * p.global_shape[d] + b.offset[d];
  return start;
}

int param_stage(const std::string& name, int layers) {
  if (name.starts_with("layers.")) {
    const auto dot = name.find('.', 7);
    const int l = std::stoi(name.substr(7, dot - 7));
    const std::string rest = name.substr(dot + 1);
    const bool attn = rest.starts_with("res_scale.attn.") || rest.starts_with("attn_norm.") || rest.starts_with("attn.");
    return attn ? 1 + 2 * l : 2 + 2 * l;
  }
  return name == "embed.weight" ? 0 : stage_count(layers) - 1;
}

void init_parameters(const ModelConfig& cfg, const optim::ParamLayout& layout, double init_std, std::uint64_t seed,
                     float* params, const mesh::Shape& given, const mesh::Coord& given_at, double router_init_gain) {
  const mesh::Shape mesh = weight_shape(given);
  const mesh::Coord at = weight_coord(given, given_at);
  const double out_scale = 1.0 / std::sqrt(2.0 * cfg.layers);
  std::memset(params, 0, static_cast<std::size_t>(layout.total_floats) * sizeof(float));
  // One splitmix64 stream over the matrices in the order of the whole model's parameters
  // (param_specs), two draws per element. Its state after k draws is seed + k * increment, so any
  // element's draws can be started directly: the matrices are filled in parallel chunks with
  // exactly the values of the serial loop (an 8B-parameter model is ~10^10 normals: minutes on
  // one core), and a rank's block of a split parameter gets exactly the values of the same
  // elements in the whole model.
  std::map<std::string, std::uint64_t> first_draw;
  {
    std::uint64_t draws = 0;
    for (const auto& p : param_specs(cfg)) {
      if (p.shape.size() <= 1) continue;
      std::uint64_t n = 1;
      for (auto d : p.shape) n *= static_cast<std::uint64_t>(d);
      first_draw[p.name] = draws, draws += 2 * n;
    }
  }
  // A piece of a block (block_pieces) to fill: its box of the whole tensor, where its elements
  // (row-major over the box) start in `params`, and the draw of the tensor's element 0.
  struct Fill {
    BlockPiece piece;
    const std::vector<std::int64_t>* global;  // the whole tensor's shape
    float* d;
    std::int64_t n;  // elements of the box
    double std;
    std::uint64_t first_draw;
  };
  std::vector<Fill> fills;
  for (const auto& p : layout.params) {
    float* d = params + p.offset;
    if (p.ndim() == 1) {
      // Biases (router, conv, residual) 0; norms, residual scales, the EDA scale and the CCA
      // temperatures 1 (temperature: Primus' from-scratch init, docs/zaya1_ops.md §6 #3).
      const bool bias = p.name.ends_with("bias");
      std::fill(d, d + p.numel, bias ? 0.0f : 1.0f);
      continue;
    }
    const auto it = first_draw.find(p.name);
    if (it == first_draw.end()) fail("init: parameter '{}' is not in model '{}'", p.name, cfg.name);
    const bool out_proj = p.name.ends_with(".wo") || p.name.ends_with("w_down");
    // The MLP router's layers after its norm: with std 0.02 each r x r layer scales its input by
    // ~0.02 sqrt(r) / 2, so the logits come out ~1e-3 and the first steps route every token by
    // the selection bias alone (one class takes the layer); fan-in scaling keeps them O(1).
    const bool router_mlp = router_init_gain > 0 && p.name.find(".moe.router.") != std::string::npos &&
                            (p.name.ends_with(".weight") && !p.name.ends_with("router.down.weight"));
    const double sd = router_mlp ? router_init_gain / std::sqrt(double(p.global_shape.back()))
                                 : init_std * (out_proj ? out_scale : 1.0);
    std::int64_t inner = 1;  // local elements per row of the block
    for (std::size_t k = 1; k < p.shape.size(); ++k) inner *= p.shape[k];
    for (BlockPiece& pc : block_pieces(p, mesh, at)) {
      std::int64_t n = 1;
      for (auto e : pc.extent) n *= e;
      float* start = d + pc.local_row * inner;
      fills.push_back({std::move(pc), &p.global_shape, start, n, sd, it->second});
    }
  }
  constexpr std::uint64_t kIncrement = 0x9E3779B97F4A7C15ull;  // Rng::next()'s
  constexpr std::int64_t kChunk = 1 << 20;
  struct Piece {
    const Fill* f;
    std::int64_t begin, end;  // box elements (row-major over the box)
  };
  std::vector<Piece> pieces;
  for (const auto& f : fills)
    for (std::int64_t b = 0; b < f.n; b += kChunk) pieces.push_back({&f, b, std::min(f.n, b + kChunk)});
  // Fills box elements [begin, end) of f: per contiguous run of the whole tensor (the box's last
  // dimensions it spans whole, and one more), each element e of the whole tensor from draw
  // first_draw + 2 e.
  auto fill = [&](const Fill& f, std::int64_t begin, std::int64_t end) {
    const auto& g = *f.global;
    const auto& ext = f.piece.extent;
    const std::size_t nd = g.size();
    std::size_t j = nd - 1;  // the run: dimensions j.. of the box, contiguous in the whole tensor
    std::int64_t run = ext[j];
    while (j > 0 && ext[j] == g[j]) run *= ext[--j];
    for (std::int64_t pos = begin; pos < end;) {
      // The whole tensor's flat index of box element pos.
      std::int64_t rest = pos, flat = 0, stride = 1;
      for (std::size_t k = nd; k-- > 0;) {
        flat += (f.piece.offset[k] + rest % ext[k]) * stride;
        rest /= ext[k];
        stride *= g[k];
      }
      const std::int64_t stop = std::min(end, (pos / run + 1) * run);
      Rng rng{seed + (f.first_draw + 2 * static_cast<std::uint64_t>(flat)) * kIncrement};
      for (std::int64_t i = pos; i < stop; ++i) f.d[i] = static_cast<float>(f.std * rng.normal());
      pos = stop;
    }
  };
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < pieces.size();) fill(*pieces[i].f, pieces[i].begin, pieces[i].end);
  };
  const std::size_t threads =
      std::min<std::size_t>(pieces.size(), std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

std::vector<std::vector<float>> initial_router_biases(const ModelConfig& cfg) {
  const int classes = cfg.experts + (cfg.router_skip_expert ? 1 : 0);
  std::vector<std::vector<float>> b(static_cast<std::size_t>(moe_layer_count(cfg)),
                                    std::vector<float>(static_cast<std::size_t>(std::max(classes, 0)), 0.f));
  if (cfg.router_skip_expert)
    for (auto& v : b) v.back() = -1.f;  // ZAYA1: the skip class starts disfavoured
  return b;
}

}  // namespace keel::model

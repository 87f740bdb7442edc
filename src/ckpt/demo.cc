#include "common/hash.h"
#include "ckpt/demo.h"

#include <algorithm>
#include <charconv>
#include <cstring>

#include <fmt/format.h>

#include "ckpt/geometry.h"
#include "common/error.h"
#include "common/units.h"

namespace keel::ckpt {

using mesh::Axis;

namespace {


// Visits the global linear index of every element of `box` in row-major order, in rows.
template <typename F>
void for_each_row(const Shape& shape, const Box& box, F f) {
  if (box.empty()) return;
  const Box whole = full_box(shape);
  for_each_run(box, whole, box, [&](const Run& r) { f(r.src, r.dst, r.count); });
}

}  // namespace

nlohmann::json DemoConfig::to_json() const {
  return {{"layers", layers}, {"hidden", hidden}, {"vocab", vocab}, {"experts", experts}, {"ffn", ffn}};
}

DemoConfig DemoConfig::from_json(const nlohmann::json& j) {
  DemoConfig c;
  c.layers = j.at("layers");
  c.hidden = j.at("hidden");
  c.vocab = j.at("vocab");
  c.experts = j.at("experts");
  c.ffn = j.at("ffn");
  return c;
}

DemoConfig parse_demo_config(const std::string& text) {
  DemoConfig c;
  std::vector<std::string> seen;
  for (const std::string& part : split_list(text)) {
    const auto eq = part.find('=');
    if (eq == std::string::npos) fail("--model '{}': '{}' is not key=value", text, part);
    const std::string key = part.substr(0, eq), val = part.substr(eq + 1);
    // A repeated key is a typo, not an override: taking either value would be a guess.
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) fail("--model '{}': {} is given twice", text, key);
    seen.push_back(key);
    int v = 0;
    const auto [end, ec] = std::from_chars(val.data(), val.data() + val.size(), v);
    if (ec != std::errc() || end != val.data() + val.size()) fail("--model '{}': '{}' is not an integer", text, val);
    if (v < 1) fail("--model '{}': {} must be at least 1", text, key);
    if (key == "layers") c.layers = v;
    else if (key == "hidden") c.hidden = v;
    else if (key == "vocab") c.vocab = v;
    else if (key == "experts") c.experts = v;
    else if (key == "ffn") c.ffn = v;
    else fail("--model '{}': unknown key '{}' (layers, hidden, vocab, experts, ffn)", text, key);
  }
  return c;
}

std::vector<DemoTensor> demo_tensors(const DemoConfig& c) {
  std::vector<DemoTensor> params;
  const std::int64_t H = c.hidden, V = c.vocab, E = c.experts, F = c.ffn;
  const int units = c.layers + 2;  // embedding, layers, head: pipeline units
  auto add = [&](std::string name, Shape shape, std::vector<std::vector<Axis>> dims, int unit) {
    mesh::Placement p;
    p.dims = std::move(dims);
    p.pp_unit = unit;
    p.pp_units = units;
    params.push_back({std::move(name), ElemType::kBF16, std::move(shape), std::move(p)});
  };
  add("embed.weight", {V, H}, {{Axis::kTensor}, {}}, 0);
  for (int l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    add(p + "attn_norm.weight", {H}, {{}}, l + 1);
    add(p + "attn.qkv.weight", {3 * H, H}, {{Axis::kTensor}, {}}, l + 1);
    add(p + "attn.out.weight", {H, H}, {{}, {Axis::kTensor}}, l + 1);
    add(p + "moe_norm.weight", {H}, {{}}, l + 1);
    add(p + "moe.router.weight", {E, H}, {{}, {}}, l + 1);
    add(p + "moe.experts.w_in", {E, 2 * F, H}, {{Axis::kExpert}, {Axis::kTensor}, {}}, l + 1);  // fused gate/up (SwiGLU)
    add(p + "moe.experts.w_out", {E, H, F}, {{Axis::kExpert}, {}, {Axis::kTensor}}, l + 1);
  }
  add("final_norm.weight", {H}, {{}}, units - 1);
  add("lm_head.weight", {V, H}, {{Axis::kTensor}, {}}, units - 1);
  std::vector<DemoTensor> all = params;
  for (const char* state : {"exp_avg", "exp_avg_sq"})
    for (const DemoTensor& p : params) {
      DemoTensor o = p;
      o.name = fmt::format("optim.{}.{}", state, p.name);
      o.type = ElemType::kF32;
      o.placement.zero = true;
      all.push_back(std::move(o));
    }
  all.push_back({"optim.step", ElemType::kI64, {}, mesh::Placement{}});  // a 0-d tensor, replicated
  return all;
}

void demo_fill(const std::string& name, ElemType type, const Shape& shape, const Box& box, std::int64_t step,
               void* out) {
  const std::size_t es = elem_size(type);
  const std::uint64_t seed = keel::splitmix64(keel::fnv1a(name) ^ keel::splitmix64(static_cast<std::uint64_t>(step)));
  char* dst = static_cast<char*>(out);
  for_each_row(shape, box, [&](std::int64_t g, std::int64_t d, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint64_t v = keel::splitmix64(seed + static_cast<std::uint64_t>(g + i));
      std::memcpy(dst + (d + i) * static_cast<std::int64_t>(es), &v, es);
    }
  });
}

std::int64_t demo_check(const std::string& name, ElemType type, const Shape& shape, const Box& box,
                        std::int64_t step, const void* data, std::string* first) {
  const std::size_t es = elem_size(type);
  const std::uint64_t seed = keel::splitmix64(keel::fnv1a(name) ^ keel::splitmix64(static_cast<std::uint64_t>(step)));
  const char* src = static_cast<const char*>(data);
  std::int64_t wrong = 0;
  for_each_row(shape, box, [&](std::int64_t g, std::int64_t d, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint64_t v = keel::splitmix64(seed + static_cast<std::uint64_t>(g + i));
      if (std::memcmp(src + (d + i) * static_cast<std::int64_t>(es), &v, es) != 0) {
        if (wrong++ == 0 && first) *first = fmt::format("tensor '{}' element {} (global linear index)", name, g + i);
      }
    }
  });
  return wrong;
}

nlohmann::json demo_rank_state(int rank, std::int64_t step) {
  return {{"rank", rank},
          {"rng", fmt::format("{:016x}", keel::splitmix64(static_cast<std::uint64_t>(rank) * 7919 + static_cast<std::uint64_t>(step)))},
          {"data_position", step * 1024}};
}

DemoShards demo_state(const DemoConfig& c, const mesh::Shape& mesh, int rank, std::int64_t step) {
  DemoShards out;
  const auto tensors = demo_tensors(c);
  out.buffers.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const DemoTensor& t = tensors[i];
    const RankShard rs = rank_shard(t.shape, t.placement, mesh, rank, i);
    if (!rs.held) continue;
    out.buffers.emplace_back(static_cast<std::size_t>(rs.box.volume()) * elem_size(t.type));
    demo_fill(t.name, t.type, t.shape, rs.box, step, out.buffers.back().data());
    out.shards.push_back({t.name, t.type, t.shape, t.placement, rs.box, out.buffers.back().data(), rs.writer});
  }
  return out;
}

DemoTarget demo_target(const DemoConfig& c, const mesh::Shape& mesh, int rank) {
  DemoTarget out;
  const auto tensors = demo_tensors(c);
  out.buffers.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const DemoTensor& t = tensors[i];
    const RankShard rs = rank_shard(t.shape, t.placement, mesh, rank, i);
    if (!rs.held) continue;
    out.buffers.emplace_back(static_cast<std::size_t>(rs.box.volume()) * elem_size(t.type));
    out.requests.push_back({t.name, t.type, t.shape, rs.box, out.buffers.back().data()});
  }
  return out;
}

std::int64_t demo_verify(const DemoTarget& t, std::int64_t step, std::string* first) {
  std::int64_t wrong = 0;
  for (const LoadRequest& q : t.requests) {
    std::string f;
    const std::int64_t w = demo_check(q.name, q.type, q.shape, q.box, step, q.data, &f);
    if (w && !wrong && first) *first = f;
    wrong += w;
  }
  return wrong;
}

}  // namespace keel::ckpt

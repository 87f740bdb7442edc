#include "bench/gemm/shapes.h"

#include <algorithm>
#include <charconv>

#include "common/error.h"
#include "common/units.h"

namespace keel::bench {
namespace {

std::int64_t parse_int(std::string_view s, std::string_view what, std::string_view whole) {
  std::int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty())
    fail("{} '{}' is not a whole number (examples: 4096, 1024,2048, 256:8192:256)", what, whole);
  if (v <= 0) fail("{} must be positive, got {}", what, v);
  return v;
}

}  // namespace

std::vector<std::int64_t> parse_dim_spec(std::string_view text, std::string_view what) {
  std::vector<std::int64_t> out;
  const auto parts = split_list(text);
  if (parts.empty()) fail("{} is empty", what);
  for (const auto& p : parts) {
    const auto c1 = p.find(':');
    if (c1 == std::string::npos) {
      out.push_back(parse_int(p, what, text));
      continue;
    }
    const auto c2 = p.find(':', c1 + 1);
    if (c2 == std::string::npos) fail("{} range '{}' needs start:stop:step", what, p);
    const std::int64_t start = parse_int(std::string_view(p).substr(0, c1), what, text);
    const std::int64_t stop = parse_int(std::string_view(p).substr(c1 + 1, c2 - c1 - 1), what, text);
    const std::int64_t step = parse_int(std::string_view(p).substr(c2 + 1), what, text);
    if (stop < start) fail("{} range '{}' ends before it starts", what, p);
    if ((stop - start) / step > 100000) fail("{} range '{}' has more than 100000 values", what, p);
    for (std::int64_t v = start; v <= stop; v += step) out.push_back(v);
  }
  return out;
}

std::vector<GemmShape> shapes_from_ranges(const std::vector<std::int64_t>& ms, const std::vector<std::int64_t>& ns,
                                          const std::vector<std::int64_t>& ks, Layout layout) {
  std::vector<GemmShape> out;
  for (auto m : ms)
    for (auto n : ns)
      for (auto k : ks) {
        GemmShape s;
        s.m = m, s.n = n, s.k = k, s.layout = layout;
        out.push_back(s);
      }
  return out;
}

std::vector<GemmShape> square_shapes(const std::vector<std::int64_t>& sizes, Layout layout) {
  std::vector<GemmShape> out;
  for (auto v : sizes) {
    GemmShape s;
    s.m = s.n = s.k = v;
    s.layout = layout;
    out.push_back(s);
  }
  return out;
}

std::vector<GemmShape> parse_shape_list(std::string_view text, Layout layout) {
  std::vector<GemmShape> out;
  const auto parts = split_list(text);
  if (parts.empty()) fail("--shapes is empty");
  for (const auto& p : parts) {
    std::vector<std::int64_t> dims;
    std::size_t start = 0;
    for (;;) {
      const auto x = p.find_first_of("xX*", start);
      dims.push_back(parse_int(std::string_view(p).substr(start, x == std::string::npos ? std::string::npos : x - start),
                               "--shapes", text));
      if (x == std::string::npos) break;
      start = x + 1;
    }
    if (dims.size() != 3 && dims.size() != 4) fail("--shapes entry '{}' is not MxNxK or MxNxKxBATCH", p);
    GemmShape s;
    s.m = dims[0], s.n = dims[1], s.k = dims[2], s.batch = dims.size() == 4 ? dims[3] : 1;
    s.layout = layout;
    out.push_back(s);
  }
  return out;
}

std::vector<GemmShape> shapes_from_model(const model::ModelConfig& config, std::int64_t tokens, bool backward) {
  std::vector<GemmShape> out;
  for (const auto& g : model::layer_gemms(config, tokens, backward)) {
    GemmShape s;
    s.name = g.name;
    s.pass = g.pass;
    s.m = g.m, s.n = g.n, s.k = g.k, s.batch = g.batch, s.layers = g.layers;
    s.layout = g.pass == "bwd_data" ? Layout::kNN : g.pass == "bwd_weight" ? Layout::kTN : Layout::kNT;
    out.push_back(s);
  }
  return out;
}

bool any_given(const ModelDims& d) {
  return d.hidden || d.heads || d.kv_heads || d.head_dim || d.ffn || d.experts || d.top_k || d.expert_width ||
         d.router_width || d.vocab;
}

model::ModelConfig config_from_dims(const ModelDims& d, bool* has_lm_head) {
  if (d.hidden <= 0) fail("model dimensions need --hidden");
  if (d.ffn <= 0 && d.experts <= 0) fail("model dimensions need --ffn (dense MLP) or --experts (MoE), or both");
  model::ModelConfig c;
  c.name = "flags";
  c.hidden = d.hidden;
  c.head_dim = d.head_dim > 0 ? d.head_dim : 128;
  c.heads = d.heads > 0 ? d.heads : std::max(1, d.hidden / c.head_dim);
  c.kv_heads = d.kv_heads > 0 ? d.kv_heads : c.heads;
  c.attention = c.kv_heads == c.heads ? model::AttentionKind::kMha : model::AttentionKind::kGqa;
  c.ffn_hidden = d.ffn;
  c.experts = d.experts;
  c.top_k = d.experts > 0 ? (d.top_k > 0 ? d.top_k : 1) : 0;
  c.expert_hidden = d.experts > 0 ? (d.expert_width > 0 ? d.expert_width : d.ffn) : 0;
  if (d.experts > 0 && c.expert_hidden <= 0) fail("--experts needs --expert-width (or --ffn)");
  if (d.router_width > 0) {
    c.router_hidden = d.router_width;  // hidden -> router width -> experts
    c.router_mlp_layers = 1;
  }
  // One layer per kind: with both a dense and an MoE MLP, layer 0 is MoE and layer 1 dense.
  c.layers = d.experts > 0 && d.ffn > 0 ? 2 : 1;
  c.moe_layer_interval = c.layers;
  *has_lm_head = d.vocab > 0;
  c.vocab_size = d.vocab > 0 ? d.vocab : 1;  // validate() needs one; the LM head is dropped below
  try {
    model::validate(c);
  } catch (const Error& e) {
    fail("model dimensions: {} (from --hidden/--heads/--kv-heads/--head-dim/...)", e.what());
  }
  return c;
}

}  // namespace keel::bench

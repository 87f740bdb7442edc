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
  // layer_gemms() routes tokens x top_k over the experts as (tokens x top_k + experts - 1) / experts.
  std::int64_t routed = 0;
  if (config.experts > 0 && (__builtin_mul_overflow(tokens, config.top_k, &routed) ||
                             __builtin_add_overflow(routed, config.experts, &routed)))
    fail("--step-tokens {} x top_k {} overflows int64", tokens, config.top_k);
  std::vector<GemmShape> out;
  for (const auto& g : model::layer_gemms(config, tokens, backward)) {
    // layer_gemms() works in the config's int sizes; a sum past INT_MAX comes back negative.
    if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0)
      fail("model '{}': GEMM '{}' has a dimension that is not positive ({}x{}x{} x{}): a size in the model is too "
           "large",
           config.name, g.name, g.m, g.n, g.k, g.batch);
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

namespace {

// Each dimension flag given must be positive (0 or less would otherwise read as "not given").
void require_positive_dims(const ModelDims& d) {
  const std::pair<const char*, const std::optional<int>*> flags[] = {
      {"--hidden", &d.hidden},         {"--heads", &d.heads},     {"--kv-heads", &d.kv_heads},
      {"--head-dim", &d.head_dim},     {"--ffn", &d.ffn},         {"--experts", &d.experts},
      {"--top-k", &d.top_k},           {"--expert-width", &d.expert_width},
      {"--router-width", &d.router_width}};
  for (const auto& [flag, value] : flags)
    if (*value && **value <= 0) fail("{} must be positive, got {}", flag, **value);
  if (d.vocab && *d.vocab <= 0) fail("--vocab must be positive, got {}", *d.vocab);
}

}  // namespace

model::ModelConfig config_from_dims(const ModelDims& d, bool* has_lm_head) {
  require_positive_dims(d);
  if (!d.hidden) fail("model dimensions need --hidden");
  if (!d.ffn && !d.experts) fail("model dimensions need --ffn (dense MLP) or --experts (MoE), or both");
  if (!d.experts && (d.top_k || d.expert_width || d.router_width))
    fail("--top-k, --expert-width and --router-width describe experts: add --experts");
  model::ModelConfig c;
  c.name = "flags";
  c.hidden = *d.hidden;
  c.head_dim = d.head_dim.value_or(128);
  c.heads = d.heads.value_or(std::max(1, c.hidden / c.head_dim));
  c.kv_heads = d.kv_heads.value_or(c.heads);
  c.attention = c.kv_heads == c.heads ? model::AttentionKind::kMha : model::AttentionKind::kGqa;
  c.ffn_hidden = d.ffn.value_or(0);
  c.experts = d.experts.value_or(0);
  c.top_k = d.experts ? d.top_k.value_or(1) : 0;
  c.expert_hidden = d.experts ? d.expert_width.value_or(c.ffn_hidden) : 0;
  if (d.experts && c.expert_hidden <= 0) fail("--experts needs --expert-width (or --ffn)");
  if (d.router_width) {
    c.router_hidden = *d.router_width;  // hidden -> router width -> experts
    c.router_mlp_layers = 1;
  }
  // One layer per kind: with both a dense and an MoE MLP, layer 0 is MoE and layer 1 dense.
  c.layers = d.experts && d.ffn ? 2 : 1;
  c.moe_layer_interval = c.layers;
  *has_lm_head = d.vocab.has_value();
  c.vocab_size = d.vocab.value_or(1);  // validate() needs one; the LM head is dropped below
  try {
    model::validate(c);
  } catch (const Error& e) {
    fail("model dimensions: {} (from --hidden/--heads/--kv-heads/--head-dim/...)", e.what());
  }
  return c;
}

}  // namespace keel::bench

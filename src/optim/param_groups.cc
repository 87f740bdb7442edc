#include "optim/param_groups.h"

#include <cmath>
#include <set>

#include "common/error.h"

namespace keel::optim {

const char* to_string(OptimizerKind k) { return k == OptimizerKind::kMuon ? "muon" : "adamw"; }

namespace {

bool glob_one(std::string_view p, std::string_view s) {
  // Iterative wildcard match with backtracking to the last '*'.
  std::size_t pi = 0, si = 0, star = std::string_view::npos, mark = 0;
  while (si < s.size()) {
    if (pi < p.size() && (p[pi] == '?' || p[pi] == s[si])) {
      ++pi, ++si;
    } else if (pi < p.size() && p[pi] == '*') {
      star = pi++, mark = si;
    } else if (star != std::string_view::npos) {
      pi = star + 1, si = ++mark;
    } else {
      return false;
    }
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool matches(const GroupRule& r, const ParamSpec& p) {
  int nd = static_cast<int>(p.shape.size());
  return nd >= r.min_ndim && nd <= r.max_ndim && glob_match(r.include, p.name) && !glob_match(r.exclude, p.name);
}

}  // namespace

bool glob_match(std::string_view pattern, std::string_view name) {
  std::size_t start = 0;
  while (start <= pattern.size()) {
    std::size_t bar = pattern.find('|', start);
    std::string_view alt = pattern.substr(start, bar == std::string_view::npos ? std::string_view::npos : bar - start);
    if (!alt.empty() && glob_one(alt, name)) return true;
    if (bar == std::string_view::npos) break;
    start = bar + 1;
  }
  return false;
}

std::vector<GroupRule> default_rules() {
  const std::string special = "*embed*|*lm_head*|*wte*";
  return {
      {"embeddings", special, "", 2, 8, OptimizerKind::kAdamW, true, 1.0},
      {"convs", "*conv*", special, 2, 8, OptimizerKind::kAdamW, true, 1.0},
      {"vectors", "*", "", 0, 1, OptimizerKind::kAdamW, false, 1.0},
      {"matrices", "*", special + "|*conv*", 2, 3, OptimizerKind::kMuon, true, 1.0},
  };
}

ParamLayout assign_groups(const std::vector<ParamSpec>& params, const std::vector<GroupRule>& rules,
                          std::int64_t align_floats) {
  if (align_floats < 1) fail("param groups: align_floats must be >= 1, got {}", align_floats);
  std::set<std::string> names;
  for (const auto& r : rules) {
    if (r.group.empty()) fail("param groups: a rule has an empty group name");
    if (!(std::isfinite(r.lr_scale) && r.lr_scale >= 0))
      fail("param groups: rule '{}' has lr_scale {} (must be finite and >= 0)", r.group, r.lr_scale);
  }
  ParamLayout layout;
  for (const auto& p : params) {
    if (!names.insert(p.name).second) fail("param groups: duplicate parameter name '{}'", p.name);
    std::int64_t numel = 1;
    for (auto d : p.shape) {
      if (d <= 0) fail("param groups: parameter '{}' has a non-positive extent in shape {}", p.name, shape_str(p.shape));
      numel *= d;
    }
    const GroupRule* found = nullptr;
    for (const auto& r : rules) {
      if (!matches(r, p)) continue;
      if (found)
        fail("param groups: parameter '{}' {} matches group rules '{}' and '{}'", p.name, shape_str(p.shape),
             found->group, r.group);
      found = &r;
    }
    if (!found) {
      std::string list;
      for (const auto& r : rules) list += (list.empty() ? "" : ", ") + r.group;
      fail("param groups: parameter '{}' {} matches no group rule (rules: {})", p.name, shape_str(p.shape),
           list.empty() ? "none" : list);
    }
    if (found->optimizer == OptimizerKind::kMuon && p.shape.size() < 2)
      fail("param groups: parameter '{}' {} is assigned to Muon by rule '{}' but Muon needs >= 2 dims", p.name,
           shape_str(p.shape), found->group);
    if (!p.placement.dims.empty() && p.placement.dims.size() != p.shape.size())
      fail("param groups: parameter '{}' {} has a placement of {} dimensions", p.name, shape_str(p.shape),
           p.placement.dims.size());
    if (!p.global_shape.empty() && p.global_shape.size() != p.shape.size())
      fail("param groups: parameter '{}' {} has a global shape {} of another rank", p.name, shape_str(p.shape),
           shape_str(p.global_shape));
    ParamInfo info;
    info.name = p.name;
    info.shape = p.shape;
    info.placement = p.placement.dims.empty() ? mesh::Placement::replicated(static_cast<int>(p.shape.size())) : p.placement;
    info.global_shape = p.global_shape.empty() ? p.shape : p.global_shape;
    info.group = found->group;
    info.optimizer = found->optimizer;
    info.weight_decay = found->weight_decay;
    info.lr_scale = found->lr_scale;
    info.offset = (layout.total_floats + align_floats - 1) / align_floats * align_floats;
    info.numel = numel;
    layout.total_floats = info.offset + numel;
    layout.params.push_back(std::move(info));
  }
  return layout;
}

}  // namespace keel::optim

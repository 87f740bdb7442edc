#include "train/param_rules.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace keel::train {

void validate(const MuonTrainOptions& m) {
  optim::validate(m.config);
  // More iterations only push singular values around the quintic's [0.68, 1.21] band; a huge
  // count is a typo, and each one costs three GEMMs per matrix.
  if (m.config.ns_steps > 100) fail("muon: ns_steps must be <= 100, got {}", m.config.ns_steps);
  if (!(std::isfinite(m.lr_scale) && m.lr_scale >= 0)) fail("muon: lr_scale must be finite and >= 0, got {}", m.lr_scale);
}

optim::MuonScale parse_muon_scale(const std::string& s) {
  if (s == "match_adamw") return optim::MuonScale::kMatchAdamW;
  if (s == "exact_rms") return optim::MuonScale::kExactRms;
  if (s == "keller") return optim::MuonScale::kKeller;
  if (s == "none") return optim::MuonScale::kNone;
  throw UsageError(fmt::format("unknown Muon scale '{}' (match_adamw, exact_rms, keller or none)", s));
}

const char* to_string(optim::MuonScale s) {
  switch (s) {
    case optim::MuonScale::kMatchAdamW: return "match_adamw";
    case optim::MuonScale::kExactRms: return "exact_rms";
    case optim::MuonScale::kKeller: return "keller";
    case optim::MuonScale::kNone: return "none";
  }
  return "?";
}

std::vector<optim::GroupRule> train_group_rules(const MuonTrainOptions& muon) {
  using optim::GroupRule;
  using optim::OptimizerKind;
  if (!muon.enabled) {
    // The groups model::param_layout() assigns (TrainParamRules.AdamWRulesMatchTheModelLayout
    // keeps the two in step).
    const std::string special = "*embed*|*lm_head*";
    return {
        GroupRule{"embeddings", special, "", 2, 8, OptimizerKind::kAdamW, true, 1.0},
        GroupRule{"convs", "*conv*", special, 2, 8, OptimizerKind::kAdamW, true, 1.0},
        GroupRule{"vectors", "*", "", 0, 1, OptimizerKind::kAdamW, false, 1.0},
        GroupRule{"matrices", "*", special + "|*conv*", 2, 8, OptimizerKind::kAdamW, true, 1.0},
    };
  }
  std::vector<GroupRule> rules = optim::default_rules();
  for (auto& r : rules) {
    if (r.optimizer != OptimizerKind::kMuon) continue;
    r.lr_scale = muon.lr_scale;
    if (!muon.adamw_matrices.empty()) r.exclude += "|" + muon.adamw_matrices;
  }
  if (!muon.adamw_matrices.empty()) {
    // Same dims and exclusions as the Muon rule, so each matrix still matches exactly one rule.
    const auto it = std::find_if(rules.begin(), rules.end(),
                                 [](const GroupRule& r) { return r.optimizer == OptimizerKind::kMuon; });
    GroupRule keep{"matrices_adamw", muon.adamw_matrices, "*embed*|*lm_head*|*wte*|*conv*", it->min_ndim,
                   it->max_ndim, OptimizerKind::kAdamW, true, 1.0};
    rules.insert(it, keep);
  }
  return rules;
}

optim::ParamLayout regroup_layout(const optim::ParamLayout& layout, const std::vector<optim::GroupRule>& rules) {
  std::vector<optim::ParamSpec> specs;
  specs.reserve(layout.params.size());
  for (const auto& p : layout.params) specs.push_back({p.name, p.shape, p.placement, p.global_shape});
  // assign_groups places each parameter at the next multiple of the alignment; recover the
  // alignment the layout was made with (the largest power of two, up to 16 floats, dividing
  // every offset) rather than assume it.
  std::int64_t align = 16;
  for (const auto& p : layout.params)
    while (align > 1 && p.offset % align != 0) align /= 2;
  optim::ParamLayout out = optim::assign_groups(specs, rules, align);
  if (out.total_floats != layout.total_floats)
    fail("regrouping the parameters changed the flat buffer size ({} -> {} floats)", layout.total_floats,
         out.total_floats);
  for (std::size_t i = 0; i < out.params.size(); ++i)
    if (out.params[i].offset != layout.params[i].offset)
      fail("regrouping the parameters moved '{}' (offset {} -> {})", out.params[i].name, layout.params[i].offset,
           out.params[i].offset);
  return out;
}

void scale_router_lr(optim::ParamLayout& layout, double scale) {
  if (!(std::isfinite(scale) && scale >= 0)) fail("router.lr_scale {} must be finite and >= 0", scale);
  for (auto& p : layout.params)
    if (p.name.find(".moe.router") != std::string::npos) p.lr_scale *= scale;
}

OptimizerShare optimizer_share(const optim::ParamLayout& layout, optim::OptimizerKind kind) {
  OptimizerShare s;
  for (const auto& p : layout.params)
    if (p.optimizer == kind) ++s.tensors, s.elements += p.numel;
  return s;
}

std::int64_t muon_scratch_floats(const optim::ParamLayout& layout) {
  std::int64_t n = 0;
  for (const auto& p : layout.params)
    if (p.optimizer == optim::OptimizerKind::kMuon) n = std::max(n, optim::muon_scratch_floats(p.rows(), p.cols()));
  return n;
}

void check_state_matches_optimizers(const optim::ParamLayout& layout, const float* m, const float* v,
                                    std::int64_t begin, std::int64_t end) {
  if (end < 0) end = layout.total_floats;
  for (const auto& p : layout.params) {
    if (p.optimizer != optim::OptimizerKind::kAdamW) continue;
    const std::int64_t b = std::max(p.offset, begin), e = std::min(p.offset + p.numel, end);
    if (b >= e) continue;
    const float* pm = m + (b - begin);
    const float* pv = v + (b - begin);
    const bool any_m = std::any_of(pm, pm + (e - b), [](float x) { return x != 0.f; });
    if (!any_m) continue;
    const bool any_v = std::any_of(pv, pv + (e - b), [](float x) { return x != 0.f; });
    if (!any_v)
      fail("optimizer state of '{}' is Muon momentum (m set, v all zero) but this run trains it with AdamW: "
           "resume with optimizer.muon.enabled: true (and the same optimizer.muon.adamw_matrices)",
           p.name);
  }
}

}  // namespace keel::train

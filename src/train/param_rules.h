// Which optimizer trains which parameter in `keel train`: the group rules (optim/param_groups.h)
// for AdamW-only training and for Muon on the weight matrices, and the optimizer settings the
// backends take (train config `optimizer:` and `optimizer.muon:`, docs/train.md).
//
// The model lays its parameters out once (model::param_layout(), AdamW groups); a backend that
// trains with Muon re-assigns the groups of that layout with train_group_rules() through
// regroup_layout(). Offsets depend only on the parameter order, sizes and alignment, never on
// the groups, so both optimizers see the same flat buffers and a checkpoint of either loads into
// the other (regroup_layout() checks that and throws if it ever stops being true).
//
// Muon's momentum lives in AdamW's m buffer at the Muon parameters' offsets (AdamW skips them),
// so a train state has the same buffers whichever optimizer runs. Their v is never used: it is
// zero in a train state, backed by no GPU memory and not stored in checkpoints
// (adamw_moment_spans() in backend.h).
#pragma once

#include <string>
#include <vector>

#include "optim/adamw.h"
#include "optim/muon.h"
#include "optim/param_groups.h"

namespace keel::train {

// `optimizer.muon` of the train config.
struct MuonTrainOptions {
  bool enabled = false;
  // momentum, nesterov, ns_steps, scale, rms_target, weight_decay (decoupled, times lr; the
  // train config defaults it to optimizer.weight_decay). coeffs: the published quintic.
  optim::MuonConfig config;
  double lr_scale = 1.0;        // Muon groups' lr = scheduled lr * lr_scale (1 with RMS matching)
  std::string adamw_matrices;   // glob alternatives ("*router*"): matrices kept on AdamW ("" = none)
};

// Throws keel::Error (one line, "muon: ...") on a MuonConfig that optim::validate rejects, a
// lr_scale that is not finite and >= 0, or ns_steps above 100.
void validate(const MuonTrainOptions& m);

// MuonScale <-> config spelling: match_adamw, exact_rms, keller, none.
optim::MuonScale parse_muon_scale(const std::string& s);  // throws keel::UsageError listing the choices
const char* to_string(optim::MuonScale s);

// Everything a backend's optimizer needs. Converts implicitly from an AdamWConfig (AdamW only),
// so make_*_backend(cfg, options, adamw, ctx) keeps working.
struct OptimizerConfig {
  optim::AdamWConfig adamw;
  MuonTrainOptions muon;
  OptimizerConfig() = default;
  OptimizerConfig(const optim::AdamWConfig& a) : adamw(a) {}  // NOLINT: implicit on purpose
  OptimizerConfig(const optim::AdamWConfig& a, const MuonTrainOptions& m) : adamw(a), muon(m) {}
};

// AdamW only (muon.enabled false): the groups of model::param_layout():
//   embeddings "*embed*|*lm_head*" >= 2-D, decay; convs "*conv*" >= 2-D, decay; vectors <= 1-D,
//   no decay; matrices >= 2-D otherwise, decay.
// Muon (enabled), optim::default_rules() plus the AdamW matrix exception:
//   embeddings "*embed*|*lm_head*|*wte*" >= 2-D  AdamW, decay
//   convs      "*conv*" >= 2-D                    AdamW, decay
//   vectors    <= 1-D (norms, biases, scales)     AdamW, no decay
//   matrices_adamw  muon.adamw_matrices, 2-3-D    AdamW, decay   (only when the glob is set)
//   matrices   2-D and 3-D otherwise              Muon, decay, lr_scale = muon.lr_scale
// (attention projections, the router, dense MLP weights and the [E, out, in] expert stacks; a
// 3-D stack is E independent matrices).
std::vector<optim::GroupRule> train_group_rules(const MuonTrainOptions& muon);

// `layout` with every parameter's group, optimizer, decay and lr_scale re-assigned by `rules`:
// optim::assign_groups over the same (name, shape) list in the same order. Throws keel::Error
// when a parameter matches no rule or two (assign_groups' message) or, defensively, when an
// offset or the total size would change.
optim::ParamLayout regroup_layout(const optim::ParamLayout& layout, const std::vector<optim::GroupRule>& rules);

// `router.lr_scale`: multiplies the lr_scale of every router parameter (names containing
// ".moe.router": the linear router, or the MLP router's layers, norm and EDA scale), whichever
// optimizer trains it. 1 leaves the layout as it is.
void scale_router_lr(optim::ParamLayout& layout, double scale);

// Number of parameters (tensors) and elements trained by `kind` in `layout`.
struct OptimizerShare {
  int tensors = 0;
  std::int64_t elements = 0;
};
OptimizerShare optimizer_share(const optim::ParamLayout& layout, optim::OptimizerKind kind);

// Scratch floats optim::muon_matrix_step() needs for the largest Muon parameter of `layout`
// (0 without Muon parameters).
std::int64_t muon_scratch_floats(const optim::ParamLayout& layout);

// Before a backend loads a train state (m, v: layout.total_floats each): throws keel::Error when
// an AdamW parameter has a non-zero m and an all-zero v, the signature of Muon momentum (a
// checkpoint trained with Muon resumed with optimizer.muon.enabled: false; AdamW would divide by
// sqrt(v) = 0 and blow the weights up). The other way round (AdamW state into a Muon run) is
// allowed: AdamW's m is a gradient moving average, a sound warm start for Muon's momentum.
// m and v hold the floats [begin, end) of the flat buffer (end < 0: all of it).
void check_state_matches_optimizers(const optim::ParamLayout& layout, const float* m, const float* v,
                                    std::int64_t begin = 0, std::int64_t end = -1);

}  // namespace keel::train

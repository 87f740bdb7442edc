// Parameter groups: which optimizer, weight decay and learning-rate scale each parameter gets,
// decided by rules on its name and dimensionality, and where it lives in the flat buffers.
//
// Every parameter must match exactly one rule; assign_groups() throws keel::Error naming the
// first parameter that matches none ("parameter 'layers.0.mix' [4, 4, 4, 4] matches no group
// rule (rules: embeddings, convs, vectors, matrices)") or two ("parameter 'x' matches group rules
// 'a' and 'b'"), so a renamed tensor cannot silently change optimizer.
//
// Patterns are globs over the whole name: '*' any run of characters, '?' one character, and
// '|' separates alternatives ("*embed*|*lm_head*"). An empty pattern matches nothing.
//
// Layout: parameters are laid out in the given order in one flat fp32 buffer (parameters,
// gradients and each optimizer state use the same offsets), each starting at a multiple of
// `align_floats` (default 16 floats = 64 bytes, the Arena alignment). ZeRO-1 later gives each
// data-parallel rank a contiguous range of that buffer for AdamW states and whole matrices for
// Muon (docs/optim.md).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "mesh/placement.h"

namespace keel::optim {

enum class OptimizerKind { kAdamW, kMuon };
const char* to_string(OptimizerKind k);

// `shape` is what is laid out in the flat buffer: the whole tensor, or one rank's block of it.
// A model's parameters also say how they lie over the mesh (model/param_layout.h): `placement`
// (which axes split which dimension) and `global_shape` (the whole tensor's); left empty they
// mean a replicated tensor of `shape`.
struct ParamSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  mesh::Placement placement;
  std::vector<std::int64_t> global_shape;
};

struct GroupRule {
  std::string group;               // e.g. "matrices"
  std::string include = "*";       // glob alternatives the name must match
  std::string exclude;             // glob alternatives the name must not match ("" = none)
  int min_ndim = 0, max_ndim = 8;  // inclusive bounds on the number of dims
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  bool weight_decay = true;
  double lr_scale = 1.0;           // multiplies the scheduled learning rate
};

struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;          // as laid out (this rank's block)
  mesh::Placement placement;                 // over the mesh (replicated when not split)
  std::vector<std::int64_t> global_shape;    // the whole tensor's
  std::string group;
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  bool weight_decay = true;
  double lr_scale = 1.0;
  std::int64_t offset = 0;  // in floats, into the flat parameter / gradient / state buffers
  std::int64_t numel = 0;

  int ndim() const { return static_cast<int>(shape.size()); }
  // Muon parameters: the matrices are the last two dims, leading dims a batch (MoE experts
  // [E, out, in] are E matrices). rows = shape[-2], cols = shape[-1].
  std::int64_t rows() const { return shape.size() >= 2 ? shape[shape.size() - 2] : 1; }
  std::int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  std::int64_t matrices() const { return numel / (rows() * cols()); }
};

struct ParamLayout {
  std::vector<ParamInfo> params;
  std::int64_t total_floats = 0;  // size of each flat buffer, padding included
};

bool glob_match(std::string_view pattern, std::string_view name);

// The default assignment (ZAYA1 / Muon practice, docs/optim.md):
//   embeddings: "*embed*|*lm_head*|*wte*", >= 2-D        -> AdamW, decay
//   convs:      "*conv*", >= 2-D                          -> AdamW, decay
//   vectors:    anything <= 1-D (norms, biases, residual scales, temperatures) -> AdamW, no decay
//   matrices:   2-D and 3-D (expert stacks) except the above -> Muon, decay
std::vector<GroupRule> default_rules();

// Assigns every parameter to its one matching rule and lays them out. Throws on an unmatched or
// doubly-matched parameter, a Muon rule matching a parameter of fewer than 2 dims, a bad shape,
// a duplicate name or a lr_scale that is not finite and >= 0.
ParamLayout assign_groups(const std::vector<ParamSpec>& params, const std::vector<GroupRule>& rules,
                          std::int64_t align_floats = 16);

}  // namespace keel::optim

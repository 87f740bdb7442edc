// Parallel layouts: a mesh of named axes (pp, dp, ep, tp) and, per tensor, a placement that
// says which axes split which dimension. Together they give every rank's shard of every
// tensor, for any world size, and pick the one rank that writes each replicated shard.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/types.h"

namespace keel::ckpt {

// Axes from outermost to innermost: rank = ((pp * dp + d) * ep + e) * tp + t.
struct Mesh {
  int pp = 1, dp = 1, ep = 1, tp = 1;
  bool zero = false;  // ZeRO-1: optimizer states are further split over dp

  int world() const { return pp * dp * ep * tp; }
  int degree(const std::string& axis) const;
  int coord(int rank, const std::string& axis) const;
  std::string str() const;  // "pp=1,dp=2,ep=1,tp=2,zero=1"
};

// The largest world a mesh may span: far beyond any job, and small enough that rank
// arithmetic in int (Mesh::world, Mesh::coord) cannot overflow.
inline constexpr int kMaxWorld = 1 << 20;

// Parses "dp=2,tp=2,ep=1,pp=1,zero=1" (any subset, any order; missing axes are 1). With
// `world` > 0, a missing dp is filled so the mesh spans the world, and a mismatch is an
// error. An axis given twice, or a mesh of more than kMaxWorld ranks, is an error. Throws
// keel::Error.
Mesh parse_mesh(const std::string& text, int world = 0);

inline const std::vector<std::string>& mesh_axes() {
  static const std::vector<std::string> axes = {"pp", "dp", "ep", "tp"};
  return axes;
}

// How one tensor is laid out over a mesh.
struct Placement {
  std::vector<std::vector<std::string>> dims;  // per dimension: axes splitting it, outermost first
  bool zero = false;       // an optimizer state: dp is appended to dimension 0's axes when mesh.zero
  int pp_unit = -1;        // pipeline unit (layer) this tensor belongs to; -1: held on every stage
  int pp_units = 1;        // number of units: stage = pp_unit * pp / pp_units

  nlohmann::json to_json() const;
  // Validates what rank_shard relies on: known axes, none twice, 0 <= pp_unit < pp_units (or
  // -1). Throws keel::Error saying which field is wrong (the caller names the tensor).
  static Placement from_json(const nlohmann::json& j);
};

// One rank's view of one tensor.
struct RankShard {
  bool held = false;    // the rank holds this tensor at all (pipeline stage)
  bool writer = false;  // the rank writes this shard (one replica of each distinct shard)
  Box box;              // may be empty (uneven splits)
};

// Splits: a dimension of n over k parts gives parts of ceil(n/k) elements, the last ones
// shorter or empty (so 5 over 4 is 2, 2, 1, 0). `salt` spreads replicated writers.
RankShard rank_shard(const Shape& shape, const Placement& p, const Mesh& mesh, int rank, std::size_t salt);

}  // namespace keel::ckpt

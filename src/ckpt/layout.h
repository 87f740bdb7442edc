// Checkpoint layouts in the mesh vocabulary (mesh/shape.h, mesh/placement.h): a mesh::Shape of
// the ranks, and per tensor a mesh::Placement saying which axes split which dimension.
// Together they give every rank's shard of every tensor, for any world size, and pick the one
// rank that writes each replicated shard.
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

#include "ckpt/types.h"
#include "mesh/placement.h"
#include "mesh/shape.h"

namespace keel::ckpt {

// A layout string (`--layout`, `--to`, a checkpoint's saved layout): mesh::parse, then with
// `world` > 0 mesh::fill_data (a missing dp fills the world; a mismatch is an error), then
// mesh::validate. Checkpoints know ZeRO stages 0 and 1 only: zero=2 or 3 is an error saying so.
// Expert parallelism is folded into dp * cp (ep must divide it), as keel train runs it: without
// a world, "ep=3" alone spans one rank and is refused; write "dp=3,ep=3". Throws keel::Error.
mesh::Shape parse_mesh(const std::string& text, int world = 0);

// A placement as checkpoint metadata stores it: {"dims": [["ep"], ["tp"], []], "zero": true,
// "pp_unit": 3, "pp_units": 6} (axes by short name; "zero" only when set, the pipeline unit only
// when the tensor lives on one stage).
nlohmann::json placement_to_json(const mesh::Placement& p);
// Validates the stored form: known axes, none twice, 0 <= pp_unit < pp_units (or -1). Throws
// keel::Error saying which field is wrong (the caller names the tensor). What the folded mesh
// cannot place (check_placement) still reads: a checkpoint of the four-axis mesh could hold it,
// and loads read boxes, not placements.
mesh::Placement placement_from_json(const nlohmann::json& j);
// What rank_shard needs of a placement, checked by it and by a save's commit: no axis twice; no
// ep beside dp or cp (the expert coordinate is derived from (dp, cp), so a tensor split over ep
// and also over dp or cp would cut the same ranks twice); no split over pp for a tensor of one
// pipeline stage. keel::Error.
void check_placement(const mesh::Placement& p);

// One rank's view of one tensor.
struct RankShard {
  bool held = false;    // the rank holds this tensor at all (pipeline stage)
  bool writer = false;  // the rank writes this shard (one replica of each distinct shard)
  Box box;              // may be empty (uneven splits)
};

// The box `rank` of `mesh` holds of a tensor of `shape` placed as `p`, and whether it writes it.
// Axes split a dimension in the order listed, each over its degree at the rank's coordinate on
// it; ep at the rank's expert coordinate ((dp * cp + c) % ep, mesh/shape.h). An optimizer state
// (p.zero) of a mesh with zero=1 is split further on dimension 0 over the data ranks holding the
// same block: the expert-data coordinate for a tensor split over ep, else dp then cp (those the
// placement does not already split over). The other coordinates (pp, dp, cp, tsp, tp; with ep:
// pp, edp, tsp, tp) the tensor is not split over are replicas, one of which writes, chosen by the
// salt and the shard: every element is written by exactly one rank. pp is no replica axis for a
// tensor of one pipeline stage (p.pp_unit >= 0): only that stage's ranks hold it.
// Splits: a dimension of n over k parts gives parts of ceil(n/k) elements, the last ones shorter
// or empty (so 5 over 4 is 2, 2, 1, 0). `salt` spreads replicated writers. keel::Error for a
// placement check_placement refuses, a mesh ep does not fold into, or zero above 1.
RankShard rank_shard(const Shape& shape, const mesh::Placement& p, const mesh::Shape& mesh, int rank, std::size_t salt);

}  // namespace keel::ckpt

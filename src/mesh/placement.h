// How one tensor lies over a mesh (shape.h): which axes split which of its dimensions. The
// parameter schema (model/param_layout.h) gives every parameter one; from it come the shape a
// rank holds, its ZeRO shards, its checkpoint boxes (ckpt/layout.h) and keel size's per-GPU
// bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "mesh/shape.h"

namespace keel::mesh {

struct Placement {
  // Per dimension: the axes splitting it, outermost first (empty: not split).
  std::vector<std::vector<Axis>> dims;
  // An optimizer state under ZeRO: dimension 0 is split further over the data ranks that hold
  // the same block (dp for a tensor no expert axis splits, the expert-data ranks for one it does).
  bool zero = false;
  // Dimension 0 as the concatenation of parts of these sizes (empty: one part), each split
  // evenly by dims[0]'s axes: a rank's block of dimension 0 is its slice of every part, in order
  // (a fused tensor such as CCA's [q; k] projection keeps each rank's q and k heads together).
  std::vector<std::int64_t> parts;
  int pp_unit = -1;  // the pipeline unit (layer) it belongs to; -1: on every stage
  int pp_units = 1;  // units in the model: stage = pp_unit * pp / pp_units

  // Not split: every rank holds all of it.
  static Placement replicated(int ndim) {
    Placement p;
    p.dims.resize(static_cast<std::size_t>(ndim));
    return p;
  }
  // Dimension `dim` split over `axis`.
  static Placement split(int ndim, int dim, Axis axis) {
    Placement p = replicated(ndim);
    p.dims[static_cast<std::size_t>(dim)].push_back(axis);
    return p;
  }
  // Dimension 0, made of `parts`, each split over `axis`.
  static Placement split_parts(int ndim, std::vector<std::int64_t> parts, Axis axis) {
    Placement p = split(ndim, 0, axis);
    p.parts = std::move(parts);
    return p;
  }
  bool splits(Axis a) const {
    for (const auto& d : dims)
      for (Axis x : d)
        if (x == a) return true;
    return false;
  }
  // The local extent of each dimension on any rank when every split is even (the degrees of a
  // dimension's axes divide it): global / product of degrees.
  std::vector<std::int64_t> local_shape(const std::vector<std::int64_t>& global, const Shape& mesh) const {
    std::vector<std::int64_t> s = global;
    for (std::size_t d = 0; d < s.size() && d < dims.size(); ++d)
      for (Axis a : dims[d]) s[d] /= mesh.degree(a);
    return s;
  }
};

}  // namespace keel::mesh

// Where the device Muon step (ops/cuda/muon.h) keeps its scratch, as byte offsets from the
// workspace's base: host arithmetic, so that the CUDA kernels carve their workspace from it and
// keel size counts exactly what keel train allocates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/param_groups.h"

namespace keel::optim {

// Per-matrix norm reductions split a matrix of `elements` into this many blocks of the device
// kernel (one fp64 partial each, summed in a fixed order): 1 to 256.
std::int64_t muon_reduction_chunks(std::int64_t elements);

// The workspace of one step over `matrices` rows x cols matrices, each region 256-byte aligned:
// the bf16 iterates X and Y [matrices, rows, cols], the bf16 Gram buffers A and B
// [matrices, s, s] (s = min(rows, cols)), the fp64 reduction partials and per-matrix factors.
struct MuonWorkspaceLayout {
  std::size_t x = 0, y = 0, a = 0, b = 0, partials = 0, factor = 0;
  std::size_t bytes = 0;  // the whole workspace
};
// Throws keel::Error on a non-positive count or dimension.
MuonWorkspaceLayout muon_workspace_layout(std::int64_t matrices, std::int64_t rows, std::int64_t cols);

// The largest workspace over the Muon parameters of `layout` (each parameter's matrices
// stepped as one batch), 0 without Muon parameters: what one device keeps for its steps.
std::size_t muon_workspace_bytes(const ParamLayout& layout);

}  // namespace keel::optim

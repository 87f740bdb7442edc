// A test sequence split (ops/sequence_split.h): whole sequences held by ONE process as S adjacent
// runs (rows b * S + s). Run s's halo is run s-1's tail (zeros for s = 0), its backward the
// adjoint; attention is the base class's whole-sequence attention, right here because the runs
// are adjacent and complete. So every result of an op through it must equal the op's without a
// split. Used by the CPU CCA tests and, as their reference, by the CUDA ones.
#pragma once

#include <cstdint>

#include "ops/sequence_split.h"
#include "tensor/tensor.h"

namespace keel::test {

class AdjacentRuns : public ops::SequenceSplit {
 public:
  explicit AdjacentRuns(int S) : S_(S) {}
  int segments() const override { return S_; }
  void halo(const Tensor& tails, const Tensor& halos) override {
    require_shape(halos, {tails.dim(0), tails.dim(1)}, "test halos");
    for (std::int64_t r = 0; r < tails.dim(0); ++r)
      for (std::int64_t j = 0; j < tails.dim(1); ++j) halos.row(r)[j] = r % S_ == 0 ? 0.f : tails.row(r - 1)[j];
  }
  void halo_backward(const Tensor& dhalos, const Tensor& dtails) override {
    require_shape(dtails, {dhalos.dim(0), dhalos.dim(1)}, "test dtails");
    for (std::int64_t r = 0; r < dhalos.dim(0); ++r)
      for (std::int64_t j = 0; j < dhalos.dim(1); ++j) dtails.row(r)[j] = r % S_ == S_ - 1 ? 0.f : dhalos.row(r + 1)[j];
  }

 private:
  int S_;
};

}  // namespace keel::test

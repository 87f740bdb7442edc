#include "ops/embedding.h"

#include <cstring>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::embedding {

namespace {
void check_ids(const std::uint32_t* ids, std::int64_t n, std::int64_t v) {
  for (std::int64_t i = 0; i < n; ++i)
    if (ids[i] >= v) fail("embedding: token id {} at position {} is outside the vocabulary of {}", ids[i], i, v);
}
}  // namespace

void forward(const std::uint32_t* ids, std::int64_t n, const Tensor& table, const Tensor& out) {
  if (table.ndim() != 2) fail("embedding: table must be [V, D], got {}", table.shape_string());
  const std::int64_t v = table.dim(0), d = table.dim(1);
  require_shape(out, {n, d}, "embedding out");
  check_ids(ids, n, v);
  parallel_for(n, 256, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) std::memcpy(out.row(i), table.row(ids[i]), sizeof(float) * d);
  });
}

void backward(const std::uint32_t* ids, std::int64_t n, const Tensor& dout, const Tensor& dtable) {
  if (dtable.ndim() != 2) fail("embedding: dtable must be [V, D], got {}", dtable.shape_string());
  const std::int64_t v = dtable.dim(0), d = dtable.dim(1);
  require_shape(dout, {n, d}, "embedding dout");
  check_ids(ids, n, v);
  for (std::int64_t i = 0; i < n; ++i) {
    const float* src = dout.row(i);
    float* dst = dtable.row(ids[i]);
    for (std::int64_t j = 0; j < d; ++j) dst[j] += src[j];
  }
}

}  // namespace keel::ops::embedding

#include "parallel/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/parallel_for.h"
#include "common/watchdog.h"

namespace keel::parallel {
namespace {

// This rank's slice [begin, begin + rows) must lie inside the vocabulary.
void check_slice(std::int64_t begin, std::int64_t rows, std::int64_t vocab, const char* what) {
  if (begin < 0 || rows < 0 || begin + rows > vocab)
    fail("{}: rows [{}, {}) are not a slice of the vocabulary of {}", what, begin, begin + rows, vocab);
}

void check_ids(const std::uint32_t* ids, std::int64_t n, std::int64_t vocab) {
  for (std::int64_t i = 0; i < n; ++i)
    if (ids[i] >= vocab)
      fail("vocab parallel embedding: token id {} at position {} is outside the vocabulary of {}", ids[i], i, vocab);
}

struct Slice {
  std::int64_t rows, width;  // this rank's vocabulary rows, the embedding width
};

// The checks both directions share: a [V_local, D] table (its gradient in backward) that is a
// slice of the vocabulary, the [n, D] rows, and token ids inside the vocabulary.
Slice check_embedding(const std::uint32_t* tokens, std::int64_t n, const Tensor& table, const char* table_name,
                      std::int64_t vocab_begin, std::int64_t vocab, const Tensor& rows, const char* rows_name) {
  if (table.ndim() != 2)
    fail("vocab parallel embedding: {} must be [V_local, D], got {}", table_name, table.shape_string());
  const Slice s{table.dim(0), table.dim(1)};
  check_slice(vocab_begin, s.rows, vocab, "vocab parallel embedding");
  require_shape(rows, {n, s.width}, rows_name);
  check_ids(tokens, n, vocab);
  return s;
}

}  // namespace

void vocab_embedding_forward(const std::uint32_t* tokens, std::int64_t n, const Tensor& w_local, std::int64_t vocab_begin,
                             std::int64_t vocab, const Tensor& out) {
  const auto [vl, d] = check_embedding(tokens, n, w_local, "table", vocab_begin, vocab, out, "vocab parallel embedding out");
  parallel_for(n, 256, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const std::int64_t r = std::int64_t(tokens[i]) - vocab_begin;
      if (r >= 0 && r < vl)
        std::memcpy(out.row(i), w_local.row(r), sizeof(float) * d);
      else
        std::memset(out.row(i), 0, sizeof(float) * d);
    }
  });
}

void vocab_embedding_backward(const std::uint32_t* tokens, std::int64_t n, const Tensor& dout, std::int64_t vocab_begin,
                              std::int64_t vocab, const Tensor& dw_local) {
  const auto [vl, d] =
      check_embedding(tokens, n, dw_local, "dtable", vocab_begin, vocab, dout, "vocab parallel embedding dout");
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t r = std::int64_t(tokens[i]) - vocab_begin;
    if (r < 0 || r >= vl) continue;
    const float* src = dout.row(i);
    float* dst = dw_local.row(r);
    for (std::int64_t j = 0; j < d; ++j) dst[j] += src[j];
  }
}

float vocab_ce_forward(const Tensor& hidden, const Tensor& w_local, std::int64_t vocab_begin, std::int64_t vocab,
                       const std::int32_t* targets, const ops::cross_entropy::Options& o, const Tensor& lse,
                       const Tensor& scratch, MPI_Comm comm) {
  const std::int64_t n = hidden.ndim() == 2 ? hidden.dim(0) : 0, vl = w_local.ndim() == 2 ? w_local.dim(0) : 0;
  require_shape(lse, {n}, "vocab parallel cross_entropy lse");
  // Local pass (checks the shapes, the slice and the targets): per row the max m and the sum of
  // exp(l - m) over this rank's slice, and the target logit where this rank holds the target.
  std::vector<float> m(n, -std::numeric_limits<float>::infinity());
  std::vector<double> sums(2 * n + 1, 0.0);  // [sum rows | target logits | V_local]: one SUM all-reduce
  double* sum = sums.data();
  double* target_logit = sums.data() + n;
  ops::cross_entropy::slice_lse(hidden, w_local, targets, o, {vocab_begin, vocab}, scratch, m.data(), sum, target_logit);
  const std::int64_t valid = ops::cross_entropy::valid_count(targets, n, o);
  if (valid == 0) {  // the same on every rank (same targets): no rank enters a collective
    lse.zero();
    return 0.f;
  }
  // Global max, then every rank's sum rescaled to it.
  std::vector<float> gm = m;
  {
    PeerWait wait("MPI_Allreduce (vocab parallel row max)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, gm.data(), int(n), MPI_FLOAT, MPI_MAX, comm), "MPI_Allreduce");
  }
  for (std::int64_t i = 0; i < n; ++i)
    if (targets[i] != o.ignore_index && sum[i] > 0) sum[i] *= std::exp(double(m[i]) - gm[i]);
  sums.back() = double(vl);
  {
    PeerWait wait("MPI_Allreduce (vocab parallel row sums)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, sums.data(), int(sums.size()), MPI_DOUBLE, MPI_SUM, comm), "MPI_Allreduce");
  }
  if (sums.back() != double(vocab))
    fail("vocab parallel cross_entropy: the group's slices hold {} rows, the vocabulary has {}", std::int64_t(sums.back()), vocab);
  return ops::cross_entropy::finish_lse(targets, n, o, gm.data(), sum, target_logit, lse);
}

void vocab_ce_backward(const Tensor& hidden, const Tensor& w_local, std::int64_t vocab_begin, std::int64_t vocab,
                       const std::int32_t* targets, const Tensor& lse, float dloss, const ops::cross_entropy::Options& o,
                       const Tensor& scratch, const Tensor& dhidden_partial, const Tensor& dw_local) {
  ops::cross_entropy::backward(hidden, w_local, targets, lse, dloss, o, scratch, dhidden_partial, dw_local,
                               {vocab_begin, vocab});
}

}  // namespace keel::parallel

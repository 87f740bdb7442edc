#include "ops/cross_entropy.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::cross_entropy {

namespace {
struct Dims {
  std::int64_t n, d, v;
};

Dims check(const Tensor& hidden, const Tensor& w, const std::int32_t* targets, const Options& o, const Tensor& lse,
           const Tensor& scratch, const Slice& slice) {
  if (hidden.ndim() != 2 || w.ndim() != 2) fail("cross_entropy: hidden and W must be 2-D, got {} and {}", hidden.shape_string(), w.shape_string());
  Dims s{hidden.dim(0), hidden.dim(1), w.dim(0)};
  require_shape(w, {s.v, s.d}, "cross_entropy W");
  if (!lse.empty()) require_shape(lse, {s.n}, "cross_entropy lse");
  const std::int64_t vocab = slice.vocab < 0 ? s.v : slice.vocab;
  if (slice.begin < 0 || slice.begin + s.v > vocab)
    fail("cross_entropy: rows [{}, {}) are not a slice of the vocabulary of {}", slice.begin, slice.begin + s.v, vocab);
  if (o.chunk < 1) fail("cross_entropy: chunk must be >= 1, got {}", o.chunk);
  if (scratch.numel() < scratch_floats(s.n, std::min(o.chunk, s.v)))
    fail("cross_entropy: scratch has {} floats, needs {}", scratch.numel(), scratch_floats(s.n, std::min(o.chunk, s.v)));
  for (std::int64_t i = 0; i < s.n; ++i)
    if (targets[i] != o.ignore_index && (targets[i] < 0 || targets[i] >= vocab))
      fail("cross_entropy: target {} at position {} outside the vocabulary of {} (ignore_index {})", targets[i], i, vocab, o.ignore_index);
  return s;
}

// logits[n, cs] = hidden[n, d] * W[v0 : v0 + cs, d]^T
void chunk_logits(const Tensor& hidden, const Tensor& w, const Dims& s, std::int64_t v0, std::int64_t cs, float* logits) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s.n), int(cs), int(s.d), 1.f, hidden.data(), int(s.d),
              w.data() + v0 * s.d, int(s.d), 0.f, logits, int(cs));
}
}  // namespace

std::int64_t scratch_floats(std::int64_t tokens, std::int64_t chunk) { return tokens * chunk; }

std::int64_t valid_count(const std::int32_t* targets, std::int64_t n, const Options& o) {
  std::int64_t c = 0;
  for (std::int64_t i = 0; i < n; ++i) c += targets[i] != o.ignore_index;
  return c;
}

void slice_lse(const Tensor& hidden, const Tensor& w, const std::int32_t* targets, const Options& o, const Slice& slice,
               const Tensor& scratch, float* m, double* sum, double* target_logit) {
  const Dims s = check(hidden, w, targets, o, Tensor(), scratch, slice);
  for (std::int64_t v0 = 0; v0 < s.v; v0 += o.chunk) {
    const std::int64_t cs = std::min(o.chunk, s.v - v0);
    const std::int64_t t0 = slice.begin + v0;  // the vocabulary id of the chunk's first column
    chunk_logits(hidden, w, s, v0, cs, scratch.data());
    parallel_for(s.n, 16, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        if (targets[i] == o.ignore_index) continue;
        const float* l = scratch.data() + i * cs;
        const float cm = *std::max_element(l, l + cs);
        const float nm = std::max(m[i], cm);
        double acc = sum[i] * std::exp(double(m[i]) - nm);  // exp(-inf) = 0 on the first chunk
        for (std::int64_t j = 0; j < cs; ++j) acc += std::exp(double(l[j]) - nm);
        m[i] = nm;
        sum[i] = acc;
        if (targets[i] >= t0 && targets[i] < t0 + cs) target_logit[i] = l[targets[i] - t0];
      }
    });
  }
}

float forward(const Tensor& hidden, const Tensor& w, const std::int32_t* targets, const Options& o, const Tensor& lse,
              const Tensor& scratch) {
  const Dims s = check(hidden, w, targets, o, lse, scratch, {});
  if (s.n == 0) return 0.f;
  std::vector<float> m(s.n, -std::numeric_limits<float>::infinity());
  std::vector<double> sum(s.n, 0.0), target_logit(s.n, 0.0);
  slice_lse(hidden, w, targets, o, {}, scratch, m.data(), sum.data(), target_logit.data());
  return finish_lse(targets, s.n, o, m.data(), sum.data(), target_logit.data(), lse);
}

float finish_lse(const std::int32_t* targets, std::int64_t n, const Options& o, const float* m, const double* sum,
                 const double* target_logit, const Tensor& lse) {
  double total = 0;
  std::int64_t valid = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (targets[i] == o.ignore_index) {
      lse[i] = 0.f;
      continue;
    }
    lse[i] = static_cast<float>(m[i] + std::log(sum[i]));
    total += double(lse[i]) - target_logit[i];
    ++valid;
  }
  return valid ? static_cast<float>(total / double(valid)) : 0.f;
}

void backward(const Tensor& hidden, const Tensor& w, const std::int32_t* targets, const Tensor& lse, float dloss,
              const Options& o, const Tensor& scratch, const Tensor& dhidden, const Tensor& dw, const Slice& slice) {
  const Dims s = check(hidden, w, targets, o, lse, scratch, slice);
  if (!dhidden.empty()) {
    require_shape(dhidden, {s.n, s.d}, "cross_entropy dhidden");
    dhidden.zero();
  }
  if (!dw.empty()) require_shape(dw, {s.v, s.d}, "cross_entropy dW");
  const std::int64_t valid = valid_count(targets, s.n, o);
  if (s.n == 0 || valid == 0) return;
  const float scale = dloss / float(valid);
  for (std::int64_t v0 = 0; v0 < s.v; v0 += o.chunk) {
    const std::int64_t cs = std::min(o.chunk, s.v - v0);
    const std::int64_t t0 = slice.begin + v0;  // the vocabulary id of the chunk's first column
    float* g = scratch.data();
    chunk_logits(hidden, w, s, v0, cs, g);
    parallel_for(s.n, 16, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        float* row = g + i * cs;
        if (targets[i] == o.ignore_index) {
          std::fill(row, row + cs, 0.f);
          continue;
        }
        for (std::int64_t j = 0; j < cs; ++j) row[j] = std::exp(row[j] - lse[i]) * scale;
        if (targets[i] >= t0 && targets[i] < t0 + cs) row[targets[i] - t0] -= scale;
      }
    });
    // dhidden[n, d] += G[n, cs] * W_c[cs, d]
    if (!dhidden.empty())
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(s.n), int(s.d), int(cs), 1.f, g, int(cs),
                  w.data() + v0 * s.d, int(s.d), 1.f, dhidden.data(), int(s.d));
    // dW_c[cs, d] += G^T[cs, n] * hidden[n, d]
    if (!dw.empty())
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(cs), int(s.d), int(s.n), 1.f, g, int(cs), hidden.data(),
                  int(s.d), 1.f, dw.data() + v0 * s.d, int(s.d));
  }
}

}  // namespace keel::ops::cross_entropy

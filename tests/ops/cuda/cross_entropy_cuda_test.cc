// The CUDA chunked cross-entropy against the CPU reference (src/ops/cross_entropy.h) on fresh
// random bf16-rounded inputs: loss and lse to fp32 rounding, the gradients to bf16 rounding of
// dlogits (norm-relative errors).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cross_entropy.h"
#include "ops/cuda/cross_entropy.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

namespace cpu_ce = ops::cross_entropy;
namespace gpu_ce = ops::cuda::cross_entropy;
using ops::cuda::bf16;
using test::all_close;
using test::DeviceArray;
using test::ints_to_device;
using test::ints_to_host;
using test::minus;
using test::norm_rel_err;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
using test::to_host;

// Random targets in [0, V), every `ignore_every`-th one ignored (-1).
std::vector<std::int32_t> random_targets(std::int64_t n, std::int64_t v, int ignore_every, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> t(n);
  for (std::int64_t i = 0; i < n; ++i) t[i] = (ignore_every > 0 && i % ignore_every == 3) ? -1 : std::int32_t(rng() % v);
  return t;
}

struct CeCase {
  std::int64_t n, d, v, chunk;
};

TEST(CrossEntropyCuda, MatchesCpuForwardAndBackward) {
  KEEL_REQUIRE_GPU();
  // V = 1000 with chunk 256 (last chunk 232), chunk 300 (last 100), a chunk larger than V, and
  // a V that is no multiple of anything nice.
  const CeCase cases[] = {{37, 64, 1000, 256}, {200, 128, 1000, 300}, {129, 96, 777, 4096}, {300, 64, 2503, 1024},
                          {512, 256, 1000, 256}};
  std::uint64_t seed = 900;
  for (const bool keep : {false, true})
  for (const CeCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.n << " D " << c.d << " V " << c.v << " chunk " << c.chunk
                                      << (keep ? " keep_logits" : ""));
    const std::int64_t n = c.n, d = c.d, v = c.v;
    const std::vector<float> hidden = rounded_bf16(random_vector(n * d, ++seed));
    const std::vector<float> w = rounded_bf16(random_vector(v * d, ++seed, -0.5f, 0.5f));
    const std::vector<std::int32_t> targets = random_targets(n, v, 5, ++seed);
    const std::vector<float> dw0 = random_vector(v * d, ++seed);  // gradients accumulate into this
    const float dloss = 0.75f;

    // CPU reference.
    cpu_ce::Options co;
    co.chunk = c.chunk;
    std::vector<float> lse(n), scratch(cpu_ce::scratch_floats(n, std::min(c.chunk, v))), dhidden(n * d), dw = dw0;
    std::vector<float> h = hidden, wm = w;
    const float want = cpu_ce::forward(Tensor(h.data(), {n, d}), Tensor(wm.data(), {v, d}), targets.data(), co,
                                       Tensor(lse.data(), {n}), Tensor(scratch.data(), {std::int64_t(scratch.size())}));
    cpu_ce::backward(Tensor(h.data(), {n, d}), Tensor(wm.data(), {v, d}), targets.data(), Tensor(lse.data(), {n}), dloss,
                     co, Tensor(scratch.data(), {std::int64_t(scratch.size())}), Tensor(dhidden.data(), {n, d}),
                     Tensor(dw.data(), {v, d}));

    // GPU.
    gpu_ce::Options go;
    go.chunk = c.chunk;
    go.keep_logits = keep;
    auto d_hidden = to_device<bf16>(hidden);
    auto d_w = to_device<bf16>(w);
    auto d_targets = ints_to_device(targets);
    DeviceArray<float> d_lse(n);
    DeviceArray<gpu_ce::Result> d_result(1);
    DeviceArray<char> d_scratch(gpu_ce::scratch_bytes(n, d, v, go));
    DeviceArray<bf16> d_dhidden(n * d);
    auto d_dw = to_device<float>(dw0);
    gpu_ce::forward(d_hidden.get(), d_w.get(), d_targets.get(), n, d, v, go, d_lse.get(), d_result.get(),
                    d_scratch.get(), nullptr);
    gpu_ce::backward(d_hidden.get(), d_w.get(), d_targets.get(), d_lse.get(), dloss, n, d, v, go, d_scratch.get(),
                     d_dhidden.get(), d_dw.get(), nullptr);
    const gpu_ce::Result got = gpu_ce::read_result(d_result.get(), nullptr);

    EXPECT_EQ(got.valid, cpu_ce::valid_count(targets.data(), n, co));
    EXPECT_EQ(got.bad_targets, 0);
    // Kept logits are bf16 (8 bits of mantissa), so the statistics are only as exact as those.
    const float loss_tol = keep ? 2e-3f : 1e-5f, lse_rtol = keep ? 2e-3f : 1e-5f, lse_atol = keep ? 2e-2f : 1e-4f;
    EXPECT_NEAR(got.loss, want, loss_tol * std::fabs(want) + 1e-5);
    EXPECT_TRUE(all_close(to_host(d_lse), lse, lse_rtol, lse_atol, "lse"));
    const double e_dh = norm_rel_err(to_host(d_dhidden), dhidden);
    const double e_dw = norm_rel_err(minus(to_host(d_dw), dw0), minus(dw, dw0));
    EXPECT_LT(e_dh, keep ? 2e-2 : 1e-2);
    EXPECT_LT(e_dw, keep ? 2e-2 : 1e-2);
    std::printf("ce N=%lld D=%lld V=%lld chunk=%lld: loss %.6f vs %.6f, rel err dhidden %.1e dW %.1e\n", (long long)n,
                (long long)d, (long long)v, (long long)c.chunk, got.loss, want, e_dh, e_dw);

    // overwrite_dw: the same gradient without the starting values (forward again: with
    // keep_logits, backward turned the kept logits into dlogits)
    go.overwrite_dw = true;
    auto o_dw = to_device<float>(dw0);
    gpu_ce::forward(d_hidden.get(), d_w.get(), d_targets.get(), n, d, v, go, d_lse.get(), d_result.get(),
                    d_scratch.get(), nullptr);
    gpu_ce::backward(d_hidden.get(), d_w.get(), d_targets.get(), d_lse.get(), dloss, n, d, v, go, d_scratch.get(),
                     d_dhidden.get(), o_dw.get(), nullptr);
    EXPECT_LT(norm_rel_err(to_host(o_dw), minus(dw, dw0)), keep ? 2e-2 : 1e-2) << "overwrite_dw";
  }
}

TEST(CrossEntropyCuda, AllIgnoredGivesZero) {
  KEEL_REQUIRE_GPU();
  const std::int64_t n = 40, d = 64, v = 500;
  const std::vector<std::int32_t> targets(n, -1);
  auto d_hidden = to_device<bf16>(random_vector(n * d, 1));
  auto d_w = to_device<bf16>(random_vector(v * d, 2));
  auto d_targets = ints_to_device(targets);
  const std::vector<float> dw0 = random_vector(v * d, 3);
  auto d_dw = to_device<float>(dw0);
  gpu_ce::Options go;
  go.chunk = 128;
  DeviceArray<float> d_lse(n);
  DeviceArray<gpu_ce::Result> d_result(1);
  DeviceArray<char> d_scratch(gpu_ce::scratch_bytes(n, d, v, go));
  auto d_dhidden = to_device<bf16>(random_vector(n * d, 4));  // must be overwritten with zeros
  gpu_ce::forward(d_hidden.get(), d_w.get(), d_targets.get(), n, d, v, go, d_lse.get(), d_result.get(), d_scratch.get(),
                  nullptr);
  gpu_ce::backward(d_hidden.get(), d_w.get(), d_targets.get(), d_lse.get(), 1.f, n, d, v, go, d_scratch.get(),
                   d_dhidden.get(), d_dw.get(), nullptr);
  const gpu_ce::Result r = gpu_ce::read_result(d_result.get(), nullptr);
  EXPECT_EQ(r.loss, 0.f);
  EXPECT_EQ(r.valid, 0);
  EXPECT_EQ(to_host(d_lse), std::vector<float>(n, 0.f));
  EXPECT_EQ(to_host(d_dhidden), std::vector<float>(n * d, 0.f));
  EXPECT_EQ(to_host(d_dw), dw0);
  // Written instead of added to: zeros, with rows to ignore and with no rows at all.
  go.overwrite_dw = true;
  gpu_ce::backward(d_hidden.get(), d_w.get(), d_targets.get(), d_lse.get(), 1.f, n, d, v, go, d_scratch.get(),
                   d_dhidden.get(), d_dw.get(), nullptr);
  EXPECT_EQ(to_host(d_dw), std::vector<float>(v * d, 0.f));
  auto dw_none = to_device<float>(dw0);
  gpu_ce::backward(d_hidden.get(), d_w.get(), d_targets.get(), d_lse.get(), 1.f, 0, d, v, go, d_scratch.get(),
                   d_dhidden.get(), dw_none.get(), nullptr);
  EXPECT_EQ(to_host(dw_none), std::vector<float>(v * d, 0.f));
}

TEST(CrossEntropyCuda, TargetOutsideVocabularyIsReported) {
  KEEL_REQUIRE_GPU();
  const std::int64_t n = 8, d = 32, v = 100;
  std::vector<std::int32_t> targets = random_targets(n, v, 0, 5);
  targets[6] = 100;
  auto d_hidden = to_device<bf16>(random_vector(n * d, 1));
  auto d_w = to_device<bf16>(random_vector(v * d, 2));
  auto d_targets = ints_to_device(targets);
  gpu_ce::Options go;
  go.chunk = 64;
  DeviceArray<float> d_lse(n);
  DeviceArray<gpu_ce::Result> d_result(1);
  DeviceArray<char> d_scratch(gpu_ce::scratch_bytes(n, d, v, go));
  gpu_ce::forward(d_hidden.get(), d_w.get(), d_targets.get(), n, d, v, go, d_lse.get(), d_result.get(), d_scratch.get(),
                  nullptr);
  EXPECT_THROW(gpu_ce::read_result(d_result.get(), nullptr), Error);
}

// ---------------------------------------------------------------- vocabulary slices
//
// Tensor parallelism simulated in one process: rank r of T runs slice_forward on its rows of
// the head, the parts are copied into one [T][2N] array (what ncclAllGather leaves on every
// rank), every rank runs combine, then slice_backward with the global lse; the fp32 dhidden
// shares are summed over the ranks on the host. Checked against the CPU whole-vocabulary op.

// The ranks' first rows: r V / T, or the given slice sizes.
std::vector<std::int64_t> slice_bounds(std::int64_t v, int ranks, const std::vector<std::int64_t>& sizes) {
  std::vector<std::int64_t> b(ranks + 1, 0);
  for (int r = 0; r <= ranks; ++r) b[r] = sizes.empty() ? r * v / ranks : (r == 0 ? 0 : b[r - 1] + sizes[r - 1]);
  return b;
}

// Rows [b, e) of a row-major [V, D] host matrix.
std::vector<float> rows_of(const std::vector<float>& m, std::int64_t d, std::int64_t b, std::int64_t e) {
  return {m.begin() + b * d, m.begin() + e * d};
}

struct SliceRun {
  std::vector<float> lse;                  // combine's, from rank 0
  gpu_ce::Result result;                   // rank 0's (read_result not called: bad targets do not throw here)
  std::vector<float> dhidden;              // the ranks' fp32 shares summed in rank order
  std::vector<std::vector<float>> dw;      // each rank's dw_local after backward
  std::vector<std::vector<float>> dh_rank; // each rank's fp32 share
};

// Runs the three steps over the slices `bounds` on one GPU. dw_local starts as the rows of dw0.
// Checks on the way that every rank's combine gives the same bits.
SliceRun run_slices(const std::vector<float>& hidden, const std::vector<float>& w, const std::vector<std::int32_t>& targets,
                    const std::vector<float>& dw0, std::int64_t n, std::int64_t d, std::int64_t v,
                    const std::vector<std::int64_t>& bounds, const gpu_ce::Options& go, float dloss) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  auto d_hidden = to_device<bf16>(hidden);
  auto d_targets = ints_to_device(targets);
  std::vector<DeviceArray<bf16>> d_w;
  std::vector<DeviceArray<char>> d_scratch;  // a rank's own: the kept logits live from forward to backward
  std::vector<DeviceArray<float>> d_part;
  DeviceArray<float> d_parts(ranks * 2 * n);
  for (int r = 0; r < ranks; ++r) {
    const std::int64_t b = bounds[r], rows = bounds[r + 1] - bounds[r];
    const gpu_ce::Slice sl{b, rows, v};
    d_w.push_back(to_device<bf16>(rows_of(w, d, b, b + rows)));
    const std::int64_t bytes = gpu_ce::slice_scratch_bytes(n, rows, go);
    EXPECT_LE(bytes, gpu_ce::scratch_bytes(n, d, std::max<std::int64_t>(rows, 1), go));
    d_scratch.emplace_back(bytes);
    d_part.push_back(to_device<float>(random_vector(2 * n, 77 + r)));  // poisoned: must be overwritten
    gpu_ce::slice_forward(d_hidden.get(), d_w[r].get(), d_targets.get(), n, d, sl, go, d_part[r].get(),
                          d_scratch[r].get(), nullptr);
    // the all-gather: rank r's part at [r][2N]
    KEEL_CUDA_CHECK(cudaMemcpyAsync(d_parts.get() + r * 2 * n, d_part[r].get(), 2 * n * sizeof(float),
                                    cudaMemcpyDeviceToDevice, nullptr));
  }
  SliceRun out;
  std::vector<DeviceArray<float>> d_lse;
  for (int r = 0; r < ranks; ++r) {  // every rank combines the same gathered parts
    d_lse.emplace_back(n);
    DeviceArray<gpu_ce::Result> d_result(1);
    gpu_ce::combine(d_parts.get(), ranks, d_targets.get(), n, v, go, d_lse[r].get(), d_result.get(), nullptr);
    gpu_ce::Result res{};
    KEEL_CUDA_CHECK(cudaMemcpy(&res, d_result.get(), sizeof res, cudaMemcpyDeviceToHost));
    const std::vector<float> lse = to_host(d_lse[r]);
    if (r == 0) {
      out.lse = lse;
      out.result = res;
    } else {
      EXPECT_EQ(lse, out.lse) << "rank " << r << "'s lse differs from rank 0's";
      EXPECT_EQ(res.loss, out.result.loss) << "rank " << r;
      EXPECT_EQ(res.valid, out.result.valid) << "rank " << r;
      EXPECT_EQ(res.bad_targets, out.result.bad_targets) << "rank " << r;
    }
  }
  out.dhidden.assign(n * d, 0.f);
  for (int r = 0; r < ranks; ++r) {
    const std::int64_t b = bounds[r], rows = bounds[r + 1] - bounds[r];
    const gpu_ce::Slice sl{b, rows, v};
    auto d_dh = to_device<float>(random_vector(n * d, 99 + r));  // poisoned: must be overwritten
    auto d_dw = to_device<float>(rows_of(dw0, d, b, b + rows));
    gpu_ce::slice_backward(d_hidden.get(), d_w[r].get(), d_targets.get(), d_lse[r].get(), dloss, n, d, sl, go,
                           d_scratch[r].get(), d_dh.get(), d_dw.get(), nullptr);
    out.dh_rank.push_back(to_host(d_dh));
    out.dw.push_back(to_host(d_dw));
    for (std::int64_t i = 0; i < n * d; ++i) out.dhidden[i] += out.dh_rank[r][i];
  }
  return out;
}

struct SliceCase {
  std::int64_t n, d, v, chunk;
  int ranks;
  std::vector<std::int64_t> sizes;  // empty: r V / T
};

TEST(CrossEntropyCuda, VocabSlicesMatchCpuWholeVocabulary) {
  KEEL_REQUIRE_GPU();
  const SliceCase cases[] = {
      {37, 64, 1000, 256, 1, {}},                // one slice: the whole head, last chunk 232
      {200, 128, 1000, 300, 2, {}},              // 500 a rank: chunks 300 + 200
      {129, 96, 1000, 128, 3, {334, 333, 333}},  // uneven; V_local and begin no multiple of 8; last chunk 78 / 77
      {300, 64, 2503, 256, 4, {}},               // 625, 626, 626, 626
      {64, 256, 1024, 4096, 4, {}},              // chunk larger than the slice
      {50, 64, 1000, 128, 3, {0, 600, 400}},     // an empty slice
  };
  std::uint64_t seed = 2000;
  for (const bool keep : {false, true})
  for (const SliceCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.n << " D " << c.d << " V " << c.v << " chunk " << c.chunk << " T "
                                      << c.ranks << (c.sizes.empty() ? "" : " uneven")
                                      << (keep ? " keep_logits" : ""));
    const std::int64_t n = c.n, d = c.d, v = c.v;
    const std::vector<float> hidden = rounded_bf16(random_vector(n * d, ++seed));
    const std::vector<float> w = rounded_bf16(random_vector(v * d, ++seed, -0.5f, 0.5f));
    const std::vector<std::int32_t> targets = random_targets(n, v, 5, ++seed);
    const std::vector<float> dw0 = random_vector(v * d, ++seed);
    const float dloss = 0.75f;

    cpu_ce::Options co;
    co.chunk = c.chunk;
    std::vector<float> lse(n), scratch(cpu_ce::scratch_floats(n, std::min(c.chunk, v))), dhidden(n * d), dw = dw0;
    std::vector<float> h = hidden, wm = w;
    const float want = cpu_ce::forward(Tensor(h.data(), {n, d}), Tensor(wm.data(), {v, d}), targets.data(), co,
                                       Tensor(lse.data(), {n}), Tensor(scratch.data(), {std::int64_t(scratch.size())}));
    cpu_ce::backward(Tensor(h.data(), {n, d}), Tensor(wm.data(), {v, d}), targets.data(), Tensor(lse.data(), {n}), dloss,
                     co, Tensor(scratch.data(), {std::int64_t(scratch.size())}), Tensor(dhidden.data(), {n, d}),
                     Tensor(dw.data(), {v, d}));

    gpu_ce::Options go;
    go.chunk = c.chunk;
    go.keep_logits = keep;
    const std::vector<std::int64_t> bounds = slice_bounds(v, c.ranks, c.sizes);
    ASSERT_EQ(bounds.back(), v);
    const SliceRun got = run_slices(hidden, w, targets, dw0, n, d, v, bounds, go, dloss);

    EXPECT_EQ(got.result.valid, cpu_ce::valid_count(targets.data(), n, co));
    EXPECT_EQ(got.result.bad_targets, 0);
    const float loss_tol = keep ? 2e-3f : 1e-5f, lse_rtol = keep ? 2e-3f : 1e-5f, lse_atol = keep ? 2e-2f : 1e-4f;
    EXPECT_NEAR(got.result.loss, want, loss_tol * std::fabs(want) + 1e-5);
    EXPECT_TRUE(all_close(got.lse, lse, lse_rtol, lse_atol, "lse"));
    for (std::int64_t i = 0; i < n; ++i)
      if (targets[i] == -1) EXPECT_EQ(got.lse[i], 0.f) << "ignored row " << i;
    const double e_dh = norm_rel_err(got.dhidden, dhidden);
    EXPECT_LT(e_dh, keep ? 2e-2 : 1e-2);
    double worst_dw = 0;
    for (int r = 0; r < c.ranks; ++r) {
      const std::int64_t b = bounds[r], e = bounds[r + 1];
      if (e == b) {
        EXPECT_EQ(got.dh_rank[r], std::vector<float>(n * d, 0.f)) << "empty slice's dhidden share";
        continue;
      }
      const double e_dw = norm_rel_err(minus(got.dw[r], rows_of(dw0, d, b, e)), minus(rows_of(dw, d, b, e),
                                                                                       rows_of(dw0, d, b, e)));
      EXPECT_LT(e_dw, keep ? 2e-2 : 1e-2) << "rank " << r << " dw rows [" << b << ", " << e << ")";
      worst_dw = std::max(worst_dw, e_dw);
    }
    std::printf("ce slices N=%lld D=%lld V=%lld chunk=%lld T=%d%s: loss %.6f vs %.6f, rel err dhidden %.1e dW %.1e\n",
                (long long)n, (long long)d, (long long)v, (long long)c.chunk, c.ranks, keep ? " keep" : "",
                got.result.loss, want, e_dh, worst_dw);

    // overwrite_dw: each rank's slice of the gradient without the starting values.
    gpu_ce::Options ow = go;
    ow.overwrite_dw = true;
    const SliceRun got_ow = run_slices(hidden, w, targets, dw0, n, d, v, bounds, ow, dloss);
    for (int r = 0; r < c.ranks; ++r) {
      const std::int64_t b = bounds[r], e = bounds[r + 1];
      if (e > b)
        EXPECT_LT(norm_rel_err(got_ow.dw[r], minus(rows_of(dw, d, b, e), rows_of(dw0, d, b, e))), keep ? 2e-2 : 1e-2)
            << "overwrite_dw rank " << r;
    }

    // One slice over the whole head equals the whole-vocabulary GPU op to fp32 rounding.
    if (c.ranks == 1) {
      auto d_hidden = to_device<bf16>(hidden);
      auto d_w = to_device<bf16>(w);
      auto d_targets = ints_to_device(targets);
      DeviceArray<float> d_lse(n);
      DeviceArray<gpu_ce::Result> d_result(1);
      DeviceArray<char> d_scratch(gpu_ce::scratch_bytes(n, d, v, go));
      DeviceArray<bf16> d_dhidden(n * d);
      auto d_dw = to_device<float>(dw0);
      gpu_ce::forward(d_hidden.get(), d_w.get(), d_targets.get(), n, d, v, go, d_lse.get(), d_result.get(),
                      d_scratch.get(), nullptr);
      gpu_ce::backward(d_hidden.get(), d_w.get(), d_targets.get(), d_lse.get(), dloss, n, d, v, go, d_scratch.get(),
                       d_dhidden.get(), d_dw.get(), nullptr);
      const gpu_ce::Result whole = gpu_ce::read_result(d_result.get(), nullptr);
      EXPECT_NEAR(got.result.loss, whole.loss, 1e-6f * std::fabs(whole.loss) + 1e-7f);
      EXPECT_EQ(got.result.valid, whole.valid);
      EXPECT_TRUE(all_close(got.lse, to_host(d_lse), 1e-6f, 1e-6f, "lse vs the whole-vocabulary op"));
      std::vector<float> dh_bf16 = got.dhidden;
      for (float& x : dh_bf16) x = test::bf16_round(x);
      EXPECT_LT(norm_rel_err(dh_bf16, to_host(d_dhidden)), 1e-3) << "dhidden vs the whole-vocabulary op";
      EXPECT_LT(norm_rel_err(got.dw[0], to_host(d_dw)), 1e-5) << "dw vs the whole-vocabulary op";
    }
  }
}

// Targets outside the vocabulary: skipped like ignored rows by every step, counted in
// bad_targets by combine (read_result throws); the rest of the rows as the CPU op with those
// rows ignored. All rows ignored: loss 0, zero shares, dw untouched.
TEST(CrossEntropyCuda, VocabSlicesBadAndIgnoredTargets) {
  KEEL_REQUIRE_GPU();
  const std::int64_t n = 40, d = 64, v = 500;
  const std::vector<std::int64_t> bounds = slice_bounds(v, 2, {});
  const std::vector<float> hidden = rounded_bf16(random_vector(n * d, 31));
  const std::vector<float> w = rounded_bf16(random_vector(v * d, 32, -0.5f, 0.5f));
  const std::vector<float> dw0 = random_vector(v * d, 33);
  std::vector<std::int32_t> targets = random_targets(n, v, 5, 34);
  targets[6] = std::int32_t(v);  // one past the vocabulary
  targets[11] = -7;              // negative, not the ignore index
  std::vector<std::int32_t> ref_targets = targets;
  ref_targets[6] = ref_targets[11] = -1;

  cpu_ce::Options co;
  co.chunk = 128;
  std::vector<float> lse(n), scratch(cpu_ce::scratch_floats(n, 128)), dhidden(n * d), dw = dw0;
  std::vector<float> h = hidden, wm = w;
  const float want = cpu_ce::forward(Tensor(h.data(), {n, d}), Tensor(wm.data(), {v, d}), ref_targets.data(), co,
                                     Tensor(lse.data(), {n}), Tensor(scratch.data(), {std::int64_t(scratch.size())}));
  cpu_ce::backward(Tensor(h.data(), {n, d}), Tensor(wm.data(), {v, d}), ref_targets.data(), Tensor(lse.data(), {n}), 1.f,
                   co, Tensor(scratch.data(), {std::int64_t(scratch.size())}), Tensor(dhidden.data(), {n, d}),
                   Tensor(dw.data(), {v, d}));

  gpu_ce::Options go;
  go.chunk = 128;
  const SliceRun got = run_slices(hidden, w, targets, dw0, n, d, v, bounds, go, 1.f);
  EXPECT_EQ(got.result.bad_targets, 2);
  EXPECT_EQ(got.result.valid, cpu_ce::valid_count(ref_targets.data(), n, co));
  EXPECT_NEAR(got.result.loss, want, 1e-5f * std::fabs(want) + 1e-5f);
  EXPECT_EQ(got.lse[6], 0.f);
  EXPECT_EQ(got.lse[11], 0.f);
  EXPECT_TRUE(all_close(got.lse, lse, 1e-5f, 1e-4f, "lse"));
  EXPECT_LT(norm_rel_err(got.dhidden, dhidden), 1e-2);
  for (int r = 0; r < 2; ++r) {
    const std::int64_t b = bounds[r], e = bounds[r + 1];
    EXPECT_LT(norm_rel_err(minus(got.dw[r], rows_of(dw0, d, b, e)), minus(rows_of(dw, d, b, e), rows_of(dw0, d, b, e))),
              1e-2);
  }
  // read_result throws on the combined result, as on forward's.
  {
    auto d_targets = ints_to_device(targets);
    DeviceArray<float> d_parts(2 * 2 * n), d_lse(n);
    DeviceArray<gpu_ce::Result> d_result(1);
    gpu_ce::combine(d_parts.get(), 2, d_targets.get(), n, v, go, d_lse.get(), d_result.get(), nullptr);
    EXPECT_THROW(gpu_ce::read_result(d_result.get(), nullptr), Error);
  }

  // Every row ignored.
  const std::vector<std::int32_t> none(n, -1);
  const SliceRun zero = run_slices(hidden, w, none, dw0, n, d, v, bounds, go, 1.f);
  EXPECT_EQ(zero.result.loss, 0.f);
  EXPECT_EQ(zero.result.valid, 0);
  EXPECT_EQ(zero.result.bad_targets, 0);
  EXPECT_EQ(zero.lse, std::vector<float>(n, 0.f));
  EXPECT_EQ(zero.dhidden, std::vector<float>(n * d, 0.f));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(zero.dw[r], rows_of(dw0, d, bounds[r], bounds[r + 1]));
}

// A slice that is not one of the vocabulary is refused before any launch.
TEST(CrossEntropyCuda, VocabSliceOutsideVocabularyThrows) {
  KEEL_REQUIRE_GPU();
  gpu_ce::Options go;
  float dummy = 0;
  EXPECT_THROW(gpu_ce::slice_forward(nullptr, nullptr, nullptr, 4, 8, gpu_ce::Slice{600, 500, 1000}, go, &dummy,
                                     nullptr, nullptr),
               Error);
  EXPECT_THROW(gpu_ce::slice_backward(nullptr, nullptr, nullptr, nullptr, 1.f, 4, 8, gpu_ce::Slice{-1, 10, 1000}, go,
                                      nullptr, &dummy, nullptr, nullptr),
               Error);
  EXPECT_THROW(gpu_ce::combine(nullptr, 0, nullptr, 4, 1000, go, nullptr, nullptr, nullptr), Error);
}

// Wall time of the LM head + loss at a training-like size (printed, not checked).
TEST(CrossEntropyCuda, Timing) {
  KEEL_REQUIRE_GPU();
  const std::int64_t n = 8192, d = 2048, v = 65536;
  for (const bool keep : {false, true}) {
  gpu_ce::Options go;
  go.chunk = 16384;
  go.keep_logits = keep;
  auto d_hidden = to_device<bf16>(random_vector(n * d, 1));
  auto d_w = to_device<bf16>(random_vector(v * d, 2, -0.05f, 0.05f));
  auto d_targets = ints_to_device(random_targets(n, v, 9, 3));
  DeviceArray<float> d_lse(n), d_dw(v * d);
  DeviceArray<gpu_ce::Result> d_result(1);
  DeviceArray<char> d_scratch(gpu_ce::scratch_bytes(n, d, v, go));
  DeviceArray<bf16> d_dhidden(n * d);
  cudaEvent_t t0, t1, t2;
  KEEL_CUDA_CHECK(cudaEventCreate(&t0));
  KEEL_CUDA_CHECK(cudaEventCreate(&t1));
  KEEL_CUDA_CHECK(cudaEventCreate(&t2));
  float fwd_ms = 0, bwd_ms = 0;
  const int iters = 5;
  for (int it = 0; it <= iters; ++it) {
    KEEL_CUDA_CHECK(cudaEventRecord(t0, nullptr));
    gpu_ce::forward(d_hidden.get(), d_w.get(), d_targets.get(), n, d, v, go, d_lse.get(), d_result.get(),
                    d_scratch.get(), nullptr);
    KEEL_CUDA_CHECK(cudaEventRecord(t1, nullptr));
    gpu_ce::backward(d_hidden.get(), d_w.get(), d_targets.get(), d_lse.get(), 1.f, n, d, v, go, d_scratch.get(),
                     d_dhidden.get(), d_dw.get(), nullptr);
    KEEL_CUDA_CHECK(cudaEventRecord(t2, nullptr));
    KEEL_CUDA_CHECK(cudaEventSynchronize(t2));
    float a = 0, b = 0;
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&a, t0, t1));
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&b, t1, t2));
    if (it > 0) fwd_ms += a / iters, bwd_ms += b / iters;
  }
  const gpu_ce::Result r = gpu_ce::read_result(d_result.get(), nullptr);
  EXPECT_TRUE(std::isfinite(r.loss));
  const double flop = 2.0 * n * d * v;
  std::printf("ce timing%s N=%lld D=%lld V=%lld chunk=%lld: forward %.3f ms (%.0f TFLOP/s), backward %.3f ms "
              "(%.0f TFLOP/s), loss %.4f\n",
              keep ? " (keep_logits)" : "", (long long)n, (long long)d, (long long)v, (long long)go.chunk, fwd_ms, flop / fwd_ms * 1e-9, bwd_ms,
              (keep ? 2 : 3) * flop / bwd_ms * 1e-9, r.loss);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  cudaEventDestroy(t2);
  }
}

}  // namespace
}  // namespace keel

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

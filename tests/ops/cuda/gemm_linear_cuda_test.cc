// The cuBLASLt GEMM seam, the CUDA linear layer and the cast kernels against host references:
// a double-precision GEMM on the same bf16-rounded operands, keel::ops::linear (the fp32 CPU
// op) and the host bf16 conversions.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/linear.h"
#include "ops/linear.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

using ops::cuda::bf16;
using ops::cuda::GemmDesc;
using ops::cuda::GemmOut;
using ops::cuda::GemmRunner;
using test::DeviceArray;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
using test::to_host;

// ---------------------------------------------------------------------------------------------
// GEMM harness: one problem's host buffers (with any leading-dimension padding, pointer offsets
// and batch gaps filled with random values too), the GPU result, and the reference check.

// Where each operand starts inside its buffer, in elements (odd offsets misalign the pointer).
struct Offsets {
  std::int64_t a = 0, b = 0, c = 0;
};

std::int64_t tight(std::int64_t ld, std::int64_t row) { return ld ? ld : std::max<std::int64_t>(row, 1); }

struct GemmProblem {
  GemmDesc d;  // exactly as passed to the runner
  Offsets off;
  std::int64_t lda = 0, ldb = 0, ldc = 0;  // effective
  std::vector<float> a, b, c0;             // host buffers; a, b bf16-exact; c0 bf16-exact for bf16 out
};

std::int64_t buffer_size(std::int64_t offset, int batch, std::int64_t stride, std::int64_t rows, std::int64_t ld) {
  return offset + (batch > 1 ? (batch - 1) * stride : 0) + rows * ld;
}

GemmProblem make_problem(const GemmDesc& d, Offsets off, std::uint64_t seed) {
  GemmProblem p;
  p.d = d;
  p.off = off;
  p.lda = tight(d.lda, d.trans_a ? d.m : d.k);
  p.ldb = tight(d.ldb, d.trans_b ? d.k : d.n);
  p.ldc = tight(d.ldc, d.n);
  const std::int64_t rows_a = d.trans_a ? d.k : d.m, rows_b = d.trans_b ? d.n : d.k;
  p.a = rounded_bf16(random_vector(buffer_size(off.a, d.batch, d.stride_a, rows_a, p.lda), seed));
  p.b = rounded_bf16(random_vector(buffer_size(off.b, d.batch, d.stride_b, rows_b, p.ldb), seed + 1));
  p.c0 = random_vector(buffer_size(off.c, d.batch, d.stride_c, d.m, p.ldc), seed + 2);
  if (d.c_type == GemmOut::kBf16) p.c0 = rounded_bf16(p.c0);
  return p;
}

// Runs the problem on the GPU and returns the whole C buffer.
std::vector<float> run_on_gpu(GemmRunner& runner, const GemmProblem& p) {
  auto a = to_device<bf16>(p.a);
  auto b = to_device<bf16>(p.b);
  if (p.d.c_type == GemmOut::kFp32) {
    auto c = to_device<float>(p.c0);
    runner.run(p.d, a.get() + p.off.a, b.get() + p.off.b, c.get() + p.off.c, nullptr);
    return to_host(c);
  }
  auto c = to_device<bf16>(p.c0);
  runner.run(p.d, a.get() + p.off.a, b.get() + p.off.b, c.get() + p.off.c, nullptr);
  return to_host(c);
}

// Checks every C element in a view against alpha op(A) op(B) + beta C0 computed in double, with
// a tolerance relative to the element's own magnitude scale alpha sum_k |a||b| + |beta c0|
// (fp32 accumulation error grows with it, not with the possibly cancelled result), and that
// every element outside the views kept its initial value.
::testing::AssertionResult check_gemm(const GemmProblem& p, const std::vector<float>& got) {
  const GemmDesc& d = p.d;
  const double rtol_out = d.c_type == GemmOut::kFp32 ? 0.0 : 8e-3;  // bf16 output rounding: 2^-9
  const double rscale = 1e-3;
  if (got.size() != p.c0.size()) return ::testing::AssertionFailure() << "C buffer size changed";
  std::vector<char> in_view(got.size(), 0);
  std::size_t bad = 0;
  std::string first;
  std::vector<double> op_a(static_cast<std::size_t>(d.m * d.k)), op_bt(static_cast<std::size_t>(d.n * d.k));
  for (int e = 0; e < d.batch; ++e) {
    const std::int64_t base_a = p.off.a + (d.batch > 1 ? e * d.stride_a : 0);
    const std::int64_t base_b = p.off.b + (d.batch > 1 ? e * d.stride_b : 0);
    const std::int64_t base_c = p.off.c + (d.batch > 1 ? e * d.stride_c : 0);
    for (std::int64_t i = 0; i < d.m; ++i)
      for (std::int64_t kk = 0; kk < d.k; ++kk)
        op_a[i * d.k + kk] = p.a[base_a + (d.trans_a ? kk * p.lda + i : i * p.lda + kk)];
    for (std::int64_t j = 0; j < d.n; ++j)
      for (std::int64_t kk = 0; kk < d.k; ++kk)
        op_bt[j * d.k + kk] = p.b[base_b + (d.trans_b ? j * p.ldb + kk : kk * p.ldb + j)];
    for (std::int64_t i = 0; i < d.m; ++i) {
      for (std::int64_t j = 0; j < d.n; ++j) {
        double sum = 0, mag = 0;
        const double* ar = &op_a[i * d.k];
        const double* br = &op_bt[j * d.k];
        for (std::int64_t kk = 0; kk < d.k; ++kk) sum += ar[kk] * br[kk], mag += std::fabs(ar[kk] * br[kk]);
        const std::int64_t idx = base_c + i * p.ldc + j;
        in_view[idx] = 1;
        double want = d.alpha * sum, scale = std::fabs(d.alpha) * mag;
        if (d.beta != 0.f) want += d.beta * double(p.c0[idx]), scale += std::fabs(d.beta * double(p.c0[idx]));
        const double tol = rtol_out * std::fabs(want) + rscale * scale + 1e-6;
        const double err = std::fabs(double(got[idx]) - want);
        if (!(err <= tol)) {
          if (bad++ == 0)
            first = ::testing::PrintToString(e) + "," + std::to_string(i) + "," + std::to_string(j) + ": got " +
                    std::to_string(got[idx]) + " want " + std::to_string(want) + " tol " + std::to_string(tol);
        }
      }
    }
  }
  std::size_t clobbered = 0;
  for (std::size_t idx = 0; idx < got.size(); ++idx)
    if (!in_view[idx] && !(got[idx] == p.c0[idx])) ++clobbered;
  if (bad == 0 && clobbered == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "m=" << d.m << " n=" << d.n << " k=" << d.k << " ta=" << d.trans_a
                                       << " tb=" << d.trans_b << " out="
                                       << (d.c_type == GemmOut::kFp32 ? "fp32" : "bf16") << " batch=" << d.batch
                                       << ": " << bad << " elements off (first at [" << first << "]), " << clobbered
                                       << " elements outside the views changed";
}

GemmDesc desc(std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb, GemmOut out) {
  GemmDesc d;
  d.m = m, d.n = n, d.k = k;
  d.trans_a = ta, d.trans_b = tb;
  d.c_type = out;
  return d;
}

// ---------------------------------------------------------------------------------------------
// GEMM

TEST(GemmCuda, EveryTransposeOddShape) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  std::uint64_t seed = 100;
  for (GemmOut out : {GemmOut::kFp32, GemmOut::kBf16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        GemmDesc d = desc(37, 130, 96, ta, tb, out);
        d.alpha = out == GemmOut::kFp32 ? 1.f : 0.75f;
        const GemmProblem p = make_problem(d, {}, seed += 10);
        EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p)));
      }
}

TEST(GemmCuda, EveryTransposeLarge) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  std::uint64_t seed = 200;
  for (GemmOut out : {GemmOut::kFp32, GemmOut::kBf16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const GemmProblem p = make_problem(desc(512, 768, 1024, ta, tb, out), {}, seed += 10);
        EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p)));
      }
}

// beta = 1 into fp32 C is how weight gradients accumulate (the wgrad shape: trans_a).
TEST(GemmCuda, BetaOneAccumulatesIntoFp32) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  GemmDesc d = desc(64, 96, 200, true, false, GemmOut::kFp32);
  d.beta = 1.f;
  const GemmProblem p = make_problem(d, {}, 300);
  EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p)));
}

TEST(GemmCuda, AlphaBetaScaleBf16Output) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  GemmDesc d = desc(45, 70, 33, false, true, GemmOut::kBf16);
  d.alpha = -0.5f, d.beta = 0.5f;
  const GemmProblem p = make_problem(d, {}, 310);
  EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p)));
}

// A separate C input (run with c_in): C = alpha op(A) op(B) + beta C_in, with the views of the
// output holding other values beforehand (they must not be read) and C_in left as it was;
// padded rows and a strided batch, bf16 and fp32 outputs.
TEST(GemmCuda, SeparateCInputIsReadAndLeftAlone) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  for (GemmOut out : {GemmOut::kBf16, GemmOut::kFp32}) {
    GemmDesc d = desc(40, 48, 72, false, true, out);
    d.alpha = 0.75f, d.beta = -1.25f;
    d.ldc = 56, d.batch = 3, d.stride_a = 40 * 72, d.stride_b = 48 * 72, d.stride_c = 40 * 56 + 8;
    const GemmProblem p = make_problem(d, {0, 0, 8}, 330 + static_cast<int>(out));
    std::vector<float> before = p.c0;  // the output: C_in's values outside the views, others inside
    const auto other = rounded_bf16(random_vector(before.size(), 340));
    for (int e = 0; e < d.batch; ++e)
      for (std::int64_t i = 0; i < d.m; ++i)
        for (std::int64_t j = 0; j < d.n; ++j) {
          const std::int64_t idx = p.off.c + e * d.stride_c + i * d.ldc + j;
          before[idx] = other[idx];
        }
    auto a = to_device<bf16>(p.a);
    auto b = to_device<bf16>(p.b);
    std::vector<float> got, c_in_after;
    if (out == GemmOut::kFp32) {
      auto c_in = to_device<float>(p.c0), c = to_device<float>(before);
      runner.run(d, a.get(), b.get(), c_in.get() + 8, c.get() + 8, nullptr);
      got = to_host(c), c_in_after = to_host(c_in);
    } else {
      auto c_in = to_device<bf16>(p.c0), c = to_device<bf16>(before);
      runner.run(d, a.get(), b.get(), c_in.get() + 8, c.get() + 8, nullptr);
      got = to_host(c), c_in_after = to_host(c_in);
    }
    EXPECT_TRUE(check_gemm(p, got));
    EXPECT_EQ(c_in_after, p.c0) << "C_in changed";
  }
  // k == 0 has nothing to add C_in to; it is refused rather than silently skipped
  DeviceArray<bf16> x(16), y(16);
  EXPECT_THROW(runner.run(desc(4, 4, 0, false, false, GemmOut::kBf16), x.get(), x.get(), x.get(), y.get(), nullptr),
               Error);
}

// Sub-matrix views: padded rows (ld > row length) and starts off every vector boundary, so the
// plan must honour both. Elements outside the views must not change.
TEST(GemmCuda, LeadingDimensionViews) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  std::uint64_t seed = 400;
  for (GemmOut out : {GemmOut::kFp32, GemmOut::kBf16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        GemmDesc d = desc(37, 50, 64, ta, tb, out);
        d.lda = (ta ? d.m : d.k) + 7;
        d.ldb = (tb ? d.k : d.n) + 3;
        d.ldc = d.n + 11;
        d.beta = out == GemmOut::kFp32 ? 1.f : 0.f;
        for (Offsets off : {Offsets{0, 0, 0}, Offsets{3, 5, 1}, Offsets{8, 16, 4}}) {
          const GemmProblem p = make_problem(d, off, seed += 10);
          EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p))) << "offsets " << off.a << "," << off.b << "," << off.c;
        }
      }
}

TEST(GemmCuda, StridedBatch) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  std::uint64_t seed = 500;
  for (GemmOut out : {GemmOut::kFp32, GemmOut::kBf16})
    for (bool ta : {false, true}) {
      GemmDesc d = desc(40, 24, 56, ta, true, out);
      d.batch = 3;
      // Gaps between the entries (filled with random values the GEMM must neither read nor write).
      d.stride_a = d.m * d.k + 13;
      d.stride_b = d.n * d.k + 5;
      d.stride_c = d.m * d.n + 9;
      d.beta = out == GemmOut::kFp32 ? 1.f : 0.f;
      const GemmProblem p = make_problem(d, {}, seed += 10);
      EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p)));
    }
  // One B shared by every entry (stride 0): the same weight applied to several inputs.
  GemmDesc d = desc(33, 48, 64, false, true, GemmOut::kBf16);
  d.batch = 4;
  d.stride_a = d.m * d.k;
  d.stride_b = 0;
  d.stride_c = d.m * d.n;
  const GemmProblem p = make_problem(d, {}, 590);
  EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p)));
}

// Per-head GEMMs of a grouped layer: each batch entry is a column block of the same rows
// (stride = the block's width, leading dimension = all blocks plus a gap), outputs side by side.
TEST(GemmCuda, StridedBatchSideBySideColumnBlocks) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  std::uint64_t seed = 600;
  const int heads = 5;
  for (GemmOut out : {GemmOut::kFp32, GemmOut::kBf16})
    for (bool ta : {false, true}) {
      GemmDesc d = desc(37, 24, 40, ta, ta, out);
      d.batch = heads;
      d.stride_a = ta ? d.m : d.k;
      d.lda = heads * d.stride_a + 3;
      d.stride_b = d.n * d.k;  // weights: one block after another
      d.stride_c = d.n;
      d.ldc = heads * d.n + 7;
      d.beta = out == GemmOut::kFp32 ? 1.f : 0.f;
      const GemmProblem p = make_problem(d, {}, seed += 10);
      EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p))) << "trans " << ta;
    }
  // Side by side, but the blocks overlap (stride < n) or the last runs past the row (ldc).
  DeviceArray<bf16> a(4096), b(4096);
  DeviceArray<float> c(4096);
  GemmDesc narrow = desc(4, 4, 4, false, false, GemmOut::kFp32);
  narrow.batch = 2, narrow.stride_a = narrow.stride_b = 16, narrow.stride_c = 3, narrow.ldc = 16;
  EXPECT_THROW(runner.run(narrow, a.get(), b.get(), c.get(), nullptr), Error);
  GemmDesc past_row = narrow;
  past_row.stride_c = 4, past_row.ldc = 7;
  EXPECT_THROW(runner.run(past_row, a.get(), b.get(), c.get(), nullptr), Error);
  past_row.ldc = 8;
  EXPECT_NO_THROW(runner.run(past_row, a.get(), b.get(), c.get(), nullptr));
}

// k == 0: an empty sum, so C = beta C (zeros for beta 0), through padded and batched views.
TEST(GemmCuda, KZeroScalesC) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  std::uint64_t seed = 600;
  for (GemmOut out : {GemmOut::kFp32, GemmOut::kBf16})
    for (float beta : {0.f, 1.f, 0.5f}) {
      GemmDesc d = desc(21, 17, 0, false, true, out);
      d.ldc = d.n + 4;
      d.batch = 2;
      d.stride_c = d.m * d.ldc + 6;
      d.beta = beta;
      const GemmProblem p = make_problem(d, {}, seed += 10);
      EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p))) << "beta " << beta;
    }
}

// With beta = 0 C is write-only: NaN left in the buffer must not reach the result.
TEST(GemmCuda, BetaZeroIgnoresNanInC) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  for (std::int64_t k : {96, 0}) {
    GemmProblem p = make_problem(desc(19, 40, k, false, true, GemmOut::kFp32), {}, 700 + k);
    std::fill(p.c0.begin(), p.c0.end(), std::numeric_limits<float>::quiet_NaN());
    EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p))) << "k " << k;
  }
}

TEST(GemmCuda, EmptyAndBadDescriptors) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  // m or n == 0: nothing runs, so null operands are fine.
  EXPECT_NO_THROW(runner.run(desc(0, 8, 8, false, false, GemmOut::kBf16), nullptr, nullptr, nullptr, nullptr));
  EXPECT_NO_THROW(runner.run(desc(8, 0, 8, false, false, GemmOut::kFp32), nullptr, nullptr, nullptr, nullptr));
  DeviceArray<bf16> a(64), b(64);
  DeviceArray<float> c(64);
  EXPECT_THROW(runner.run(desc(-1, 8, 8, false, false, GemmOut::kFp32), a.get(), b.get(), c.get(), nullptr), Error);
  GemmDesc short_lda = desc(4, 4, 8, false, false, GemmOut::kFp32);
  short_lda.lda = 7;
  EXPECT_THROW(runner.run(short_lda, a.get(), b.get(), c.get(), nullptr), Error);
  GemmDesc no_batch = desc(4, 4, 4, false, false, GemmOut::kFp32);
  no_batch.batch = 0;
  EXPECT_THROW(runner.run(no_batch, a.get(), b.get(), c.get(), nullptr), Error);
  GemmDesc overlapping = desc(4, 4, 4, false, false, GemmOut::kFp32);
  overlapping.batch = 2;
  overlapping.stride_a = overlapping.stride_b = 16;
  overlapping.stride_c = 8;
  EXPECT_THROW(runner.run(overlapping, a.get(), b.get(), c.get(), nullptr), Error);
  EXPECT_THROW(runner.run(desc(4, 4, 4, false, false, GemmOut::kFp32), a.get(), nullptr, c.get(), nullptr), Error);
}

TEST(GemmCuda, RepeatedShapeReusesPlan) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  DeviceArray<bf16> a(64 * 64), b(64 * 64);
  DeviceArray<float> c(64 * 64);
  const GemmDesc d = desc(64, 64, 64, false, true, GemmOut::kFp32);
  runner.run(d, a.get(), b.get(), c.get(), nullptr);
  runner.run(d, a.get(), b.get(), c.get(), nullptr);
  EXPECT_EQ(runner.cached_plans(), 1u);
  runner.run(desc(32, 64, 64, false, true, GemmOut::kFp32), a.get(), b.get(), c.get(), nullptr);
  EXPECT_EQ(runner.cached_plans(), 2u);
  KEEL_CUDA_CHECK(cudaDeviceSynchronize());
}

// MoE expert GEMMs: a new row count (m, or k of the weight gradient) nearly every step. Counts
// in one bucket share one algorithm choice (one heuristic query), and every one is still right.
TEST(GemmCuda, VaryingRowCountsShareOneAlgorithm) {
  KEEL_REQUIRE_GPU();
  GemmRunner runner;
  std::uint64_t seed = 700;
  for (std::int64_t m : {130, 150, 191, 256}) {  // one bucket: (128, 256]
    const GemmProblem p = make_problem(desc(m, 96, 160, false, true, GemmOut::kBf16), {}, seed += 10);
    EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p))) << "m " << m;
  }
  for (std::int64_t k : {300, 333, 384}) {  // the weight-gradient shape: k is the row count
    const GemmProblem p = make_problem(desc(96, 160, k, true, false, GemmOut::kFp32), {}, seed += 10);
    EXPECT_TRUE(check_gemm(p, run_on_gpu(runner, p))) << "k " << k;
  }
  EXPECT_EQ(runner.cached_plans(), 7u);
  EXPECT_EQ(runner.cached_algorithms(), 2u);
}

TEST(GemmCuda, ThreadGemmIsOnePerThread) {
  KEEL_REQUIRE_GPU();
  GemmRunner* here = &ops::cuda::thread_gemm();
  EXPECT_EQ(here, &ops::cuda::thread_gemm());
  GemmRunner* there = nullptr;
  std::thread([&] { there = &ops::cuda::thread_gemm(); }).join();
  EXPECT_NE(here, there);
}

// Prints (does not assert) bf16 GEMM throughput at 8192^3: NN and the linear-forward layout.
TEST(GemmCuda, Throughput8192) {
  KEEL_REQUIRE_GPU();
  constexpr std::int64_t kN = 8192;
  DeviceArray<bf16> a(kN * kN), b(kN * kN), c(kN * kN);
  {
    // Random operands (not zeros: tensor-core power and clocks depend on the data), made by
    // tiling one random chunk instead of generating 128M numbers on the host.
    constexpr std::int64_t kChunk = 1 << 20;
    auto chunk = to_device<bf16>(rounded_bf16(random_vector(kChunk, 800)));
    for (std::int64_t i = 0; i < kN * kN; i += kChunk) {
      KEEL_CUDA_CHECK(cudaMemcpy(a.get() + i, chunk.get(), kChunk * sizeof(bf16), cudaMemcpyDeviceToDevice));
      KEEL_CUDA_CHECK(cudaMemcpy(b.get() + i, chunk.get(), kChunk * sizeof(bf16), cudaMemcpyDeviceToDevice));
    }
  }
  GemmRunner runner;
  cudaEvent_t start, stop;
  KEEL_CUDA_CHECK(cudaEventCreate(&start));
  KEEL_CUDA_CHECK(cudaEventCreate(&stop));
  for (bool tb : {false, true}) {
    const GemmDesc d = desc(kN, kN, kN, false, tb, GemmOut::kBf16);
    for (int i = 0; i < 3; ++i) runner.run(d, a.get(), b.get(), c.get(), nullptr);
    constexpr int kIters = 10;
    KEEL_CUDA_CHECK(cudaEventRecord(start));
    for (int i = 0; i < kIters; ++i) runner.run(d, a.get(), b.get(), c.get(), nullptr);
    KEEL_CUDA_CHECK(cudaEventRecord(stop));
    KEEL_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    const double per = ms / kIters;
    const double tflops = 2.0 * kN * kN * kN / (per * 1e-3) / 1e12;
    std::printf("[ gemm     ] bf16 %s 8192x8192x8192: %.3f ms, %.1f TFLOP/s\n", tb ? "NT (x W^T)" : "NN", per, tflops);
  }
  KEEL_CUDA_CHECK(cudaEventDestroy(start));
  KEEL_CUDA_CHECK(cudaEventDestroy(stop));
}

// ---------------------------------------------------------------------------------------------
// Linear (against keel::ops::linear with no bias, on the same bf16-rounded operands)

struct LinearCase {
  std::int64_t n, in, out;
  std::vector<float> x, w, dy;
};

LinearCase linear_case(std::int64_t n, std::int64_t in, std::int64_t out, std::uint64_t seed) {
  return {n, in, out, rounded_bf16(random_vector(n * in, seed)), rounded_bf16(random_vector(out * in, seed + 1)),
          rounded_bf16(random_vector(n * out, seed + 2))};
}

std::vector<float> reference_forward(LinearCase& c) {
  std::vector<float> y(c.n * c.out);
  ops::linear::forward(Tensor(c.x.data(), {c.n, c.in}), Tensor(c.w.data(), {c.out, c.in}), Tensor(),
                       Tensor(y.data(), {c.n, c.out}));
  return y;
}

TEST(LinearCuda, ForwardMatchesReference) {
  KEEL_REQUIRE_GPU();
  LinearCase c = linear_case(67, 96, 130, 900);
  const std::vector<float> want = reference_forward(c);
  auto x = to_device<bf16>(c.x), w = to_device<bf16>(c.w);
  auto y = to_device<bf16>(random_vector(c.n * c.out, 905));  // overwritten, not accumulated
  ops::cuda::linear::forward(ops::cuda::thread_gemm(), x.get(), w.get(), y.get(), c.n, c.in, c.out, nullptr);
  EXPECT_TRUE(test::all_close(to_host(y), want, 1e-2f, 1e-2f, "y"));
}

TEST(LinearCuda, ForwardF32MatchesReference) {
  KEEL_REQUIRE_GPU();
  LinearCase c = linear_case(67, 320, 130, 910);
  const std::vector<float> want = reference_forward(c);
  auto x = to_device<bf16>(c.x), w = to_device<bf16>(c.w);
  auto y = to_device<float>(random_vector(c.n * c.out, 915));
  ops::cuda::linear::forward_f32(ops::cuda::thread_gemm(), x.get(), w.get(), y.get(), c.n, c.in, c.out, nullptr);
  EXPECT_TRUE(test::all_close(to_host(y), want, 1e-4f, 1e-4f, "y fp32"));
}

// Two backward calls: dx is overwritten (equal to one reference call), dW accumulates twice on
// top of its random starting value.
TEST(LinearCuda, BackwardMatchesReferenceAndAccumulates) {
  KEEL_REQUIRE_GPU();
  LinearCase c = linear_case(67, 96, 130, 920);
  const std::vector<float> dw0 = random_vector(c.out * c.in, 925);
  std::vector<float> want_dx(c.n * c.in), want_dw = dw0;
  const Tensor tx(c.x.data(), {c.n, c.in}), tw(c.w.data(), {c.out, c.in}), tdy(c.dy.data(), {c.n, c.out});
  for (int call = 0; call < 2; ++call)
    ops::linear::backward(tx, tw, tdy, Tensor(want_dx.data(), {c.n, c.in}), Tensor(want_dw.data(), {c.out, c.in}),
                          Tensor());

  auto x = to_device<bf16>(c.x), w = to_device<bf16>(c.w), dy = to_device<bf16>(c.dy);
  auto dx = to_device<bf16>(random_vector(c.n * c.in, 926));
  auto dw = to_device<float>(dw0);
  for (int call = 0; call < 2; ++call)
    ops::cuda::linear::backward(ops::cuda::thread_gemm(), x.get(), w.get(), dy.get(), dx.get(), dw.get(), c.n, c.in,
                                c.out, nullptr);
  EXPECT_TRUE(test::all_close(to_host(dx), want_dx, 1e-2f, 1e-2f, "dx"));
  EXPECT_TRUE(test::all_close(to_host(dw), want_dw, 1e-4f, 1e-4f, "dw"));
}

TEST(LinearCuda, BackwardSkipsNullGradients) {
  KEEL_REQUIRE_GPU();
  LinearCase c = linear_case(29, 72, 40, 930);
  std::vector<float> want_dx(c.n * c.in), want_dw(c.out * c.in, 0.f);
  ops::linear::backward(Tensor(c.x.data(), {c.n, c.in}), Tensor(c.w.data(), {c.out, c.in}),
                        Tensor(c.dy.data(), {c.n, c.out}), Tensor(want_dx.data(), {c.n, c.in}),
                        Tensor(want_dw.data(), {c.out, c.in}), Tensor());
  auto x = to_device<bf16>(c.x), w = to_device<bf16>(c.w), dy = to_device<bf16>(c.dy);
  auto& gemm = ops::cuda::thread_gemm();
  auto dx = to_device<bf16>(random_vector(c.n * c.in, 935));
  ops::cuda::linear::backward(gemm, x.get(), w.get(), dy.get(), dx.get(), nullptr, c.n, c.in, c.out, nullptr);
  EXPECT_TRUE(test::all_close(to_host(dx), want_dx, 1e-2f, 1e-2f, "dx only"));
  DeviceArray<float> dw(c.out * c.in);  // zeros
  ops::cuda::linear::backward(gemm, x.get(), w.get(), dy.get(), nullptr, dw.get(), c.n, c.in, c.out, nullptr);
  EXPECT_TRUE(test::all_close(to_host(dw), want_dw, 1e-4f, 1e-4f, "dw only"));
}

// out == 0: dx = dy W is an empty sum, so zeros; n == 0: dW gets nothing added.
TEST(LinearCuda, EmptyExtents) {
  KEEL_REQUIRE_GPU();
  auto& gemm = ops::cuda::thread_gemm();
  auto x = to_device<bf16>(rounded_bf16(random_vector(5 * 8, 940)));
  auto dx = to_device<bf16>(random_vector(5 * 8, 941));
  DeviceArray<bf16> none;
  ops::cuda::linear::backward(gemm, x.get(), none.get(), none.get(), dx.get(), nullptr, 5, 8, 0, nullptr);
  EXPECT_EQ(to_host(dx), std::vector<float>(5 * 8, 0.f));
  const std::vector<float> dw0 = random_vector(3 * 8, 942);
  auto dw = to_device<float>(dw0);
  auto w = to_device<bf16>(rounded_bf16(random_vector(3 * 8, 943)));
  ops::cuda::linear::backward(gemm, none.get(), w.get(), none.get(), nullptr, dw.get(), 0, 8, 3, nullptr);
  EXPECT_EQ(to_host(dw), dw0);
  EXPECT_THROW(ops::cuda::linear::forward(gemm, x.get(), w.get(), dx.get(), -1, 8, 3, nullptr), Error);
}

// ---------------------------------------------------------------------------------------------
// Casts: exact against the host conversions, for lengths around the vector widths and pointers
// at every element offset (input and output misaligned alike or differently), with guard
// elements around the output that must not change.

const std::vector<std::int64_t> kCastLengths = {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 1000003};
const std::vector<std::pair<int, int>> kCastOffsets = {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {1, 0}, {0, 3}, {2, 1}, {5, 7}};
constexpr int kGuard = 4;

TEST(CastCuda, F32ToBf16MatchesHostRounding) {
  KEEL_REQUIRE_GPU();
  std::uint64_t seed = 1000;
  for (std::int64_t n : kCastLengths)
    for (auto [in_off, out_off] : kCastOffsets) {
      const std::vector<float> in = random_vector(in_off + n, ++seed, -300.f, 300.f);
      const std::vector<float> out0 = rounded_bf16(random_vector(out_off + n + kGuard, ++seed));
      std::vector<float> want = out0;
      for (std::int64_t i = 0; i < n; ++i) want[out_off + i] = test::bf16_round(in[in_off + i]);
      auto d_in = to_device<float>(in);
      auto d_out = to_device<bf16>(out0);
      ops::cuda::f32_to_bf16(d_in.get() + in_off, d_out.get() + out_off, n, nullptr);
      EXPECT_EQ(to_host(d_out), want) << "n " << n << " offsets " << in_off << "," << out_off;
    }
}

TEST(CastCuda, Bf16ToF32IsExact) {
  KEEL_REQUIRE_GPU();
  std::uint64_t seed = 2000;
  for (std::int64_t n : kCastLengths)
    for (auto [in_off, out_off] : kCastOffsets) {
      const std::vector<float> in = rounded_bf16(random_vector(in_off + n, ++seed, -300.f, 300.f));
      const std::vector<float> out0 = random_vector(out_off + n + kGuard, ++seed);
      std::vector<float> want = out0;
      for (std::int64_t i = 0; i < n; ++i) want[out_off + i] = in[in_off + i];
      auto d_in = to_device<bf16>(in);
      auto d_out = to_device<float>(out0);
      ops::cuda::bf16_to_f32(d_in.get() + in_off, d_out.get() + out_off, n, nullptr);
      EXPECT_EQ(to_host(d_out), want) << "n " << n << " offsets " << in_off << "," << out_off;
    }
}

TEST(CastCuda, AddBf16ToF32Accumulates) {
  KEEL_REQUIRE_GPU();
  std::uint64_t seed = 3000;
  for (std::int64_t n : kCastLengths)
    for (auto [in_off, out_off] : kCastOffsets) {
      const std::vector<float> in = rounded_bf16(random_vector(in_off + n, ++seed, -3.f, 3.f));
      const std::vector<float> acc0 = random_vector(out_off + n + kGuard, ++seed);
      std::vector<float> want = acc0;
      for (std::int64_t i = 0; i < n; ++i) want[out_off + i] = acc0[out_off + i] + in[in_off + i];
      auto d_in = to_device<bf16>(in);
      auto d_acc = to_device<float>(acc0);
      ops::cuda::add_bf16_to_f32(d_in.get() + in_off, d_acc.get() + out_off, n, nullptr);
      EXPECT_EQ(to_host(d_acc), want) << "n " << n << " offsets " << in_off << "," << out_off;
    }
}

}  // namespace
}  // namespace keel

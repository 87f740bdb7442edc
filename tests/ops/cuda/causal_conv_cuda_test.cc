// The CUDA depthwise causal conv's halo (ops/cuda/causal_conv.h: the inputs before a run of a
// split sequence) against the CPU op's halo (ops/causal_conv.h), and, mirroring the CPU tests
// OpConv.Halo* (tests/ops/zaya_residual_conv_test.cc), a sequence split into two parts on the GPU
// against the GPU's whole sequence. Tolerances as CausalConvCuda.* (zaya_ops_cuda_test.cc): the
// depthwise conv in fp32 (y rounded to bf16), the grouped conv's GEMMs to fp32 accumulation
// order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/causal_conv.h"
#include "ops/cuda/causal_conv.h"
#include "ops/cuda/gemm.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

using cuda_bf16 = __nv_bfloat16;
using test::all_close;
using test::DeviceArray;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
using test::to_host;

// Rows t0 .. t0 + n - 1 of each of the B sequences of v [B, T, C].
std::vector<float> take_rows(const std::vector<float>& v, std::int64_t B, std::int64_t T, std::int64_t C,
                             std::int64_t t0, std::int64_t n) {
  std::vector<float> out(B * n * C);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t c = 0; c < C; ++c) out[(b * n + t) * C + c] = v[(b * T + t0 + t) * C + c];
  return out;
}

// Packed [B, P, C] halos spread into rows `stride` floats apart (the rest of each row poisoned),
// and back.
std::vector<float> spread(const std::vector<float>& packed, std::int64_t B, std::int64_t PC, std::int64_t stride) {
  std::vector<float> out(B * stride, 1e3f);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < PC; ++i) out[b * stride + i] = packed[b * PC + i];
  return out;
}
std::vector<float> gather(const std::vector<float>& rows, std::int64_t B, std::int64_t PC, std::int64_t stride) {
  std::vector<float> out(B * PC);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < PC; ++i) out[b * PC + i] = rows[b * stride + i];
  return out;
}

// GPU depthwise forward and backward with a halo against the CPU op with the same halo: y, dx,
// dhalo (overwritten: poisoned first), dw and db (accumulated). Halos packed (stride 0) and
// inside wider rows (stride > P * C, as CCA's [runs, F] halos), dx and dhalo each alone too.
TEST(CausalConvCuda, DepthwiseHaloMatchesCpu) {
  KEEL_REQUIRE_GPU();
  const std::int64_t B = 3, T = 11, C = 40;
  for (const int W : {1, 2, 3}) {
    for (const int extra : {0, 1, 2}) {
      for (const std::int64_t pad : {0, 7}) {
        SCOPED_TRACE(testing::Message() << "W " << W << " extra " << extra << " row padding " << pad);
        const std::int64_t To = T + extra, P = extra + W - 1, PC = P * C, stride = pad ? PC + pad : 0;
        const std::int64_t rows = stride ? stride : PC;
        auto x = rounded_bf16(random_vector(B * T * C, 40 + W));
        auto halo = rounded_bf16(random_vector(B * PC, 41 + extra));
        auto w = random_vector(C * W, 42), b = random_vector(C, 43, -0.3f, 0.3f);
        auto dy = random_vector(B * To * C, 44), dw0 = random_vector(C * W, 45), db0 = random_vector(C, 46);
        std::vector<float> y(B * To * C), dx(B * T * C), dhalo(B * PC), dw = dw0, db = db0;
        const Tensor th(halo.data(), {B, P, C});
        ops::causal_conv::depthwise_forward(Tensor(x.data(), {B, T, C}), Tensor(w.data(), {C, W}),
                                            Tensor(b.data(), {C}), extra, Tensor(y.data(), {B, To, C}), th);
        ops::causal_conv::depthwise_backward(Tensor(x.data(), {B, T, C}), Tensor(w.data(), {C, W}), extra,
                                             Tensor(dy.data(), {B, To, C}), Tensor(dx.data(), {B, T, C}),
                                             Tensor(dw.data(), {C, W}), Tensor(db.data(), {C}), th,
                                             Tensor(dhalo.data(), {B, P, C}));

        auto d_x = to_device<cuda_bf16>(x), d_halo = to_device<cuda_bf16>(spread(halo, B, PC, rows));
        auto d_w = to_device<float>(w), d_b = to_device<float>(b), d_dy = to_device<float>(dy);
        auto d_dw = to_device<float>(dw0), d_db = to_device<float>(db0);
        DeviceArray<cuda_bf16> d_y(B * To * C);
        auto d_dx = to_device<float>(random_vector(B * T * C, 47));
        auto d_dhalo = to_device<float>(std::vector<float>(B * rows, 7.f));
        ops::cuda::causal_conv::depthwise_forward(d_x.get(), d_w.get(), d_b.get(), extra, d_y.get(), B, T, C, W,
                                                  nullptr, d_halo.get(), stride);
        ops::cuda::causal_conv::depthwise_backward(d_x.get(), d_w.get(), extra, d_dy.get(), d_dx.get(), d_dw.get(),
                                                   d_db.get(), B, T, C, W, nullptr, d_halo.get(), d_dhalo.get(),
                                                   stride);
        EXPECT_TRUE(all_close(to_host(d_y), y, 4e-3f, 1e-5f, "y (bf16)"));
        EXPECT_TRUE(all_close(to_host(d_dx), dx, 1e-5f, 1e-5f, "dx"));
        const auto gdh = to_host(d_dhalo);
        EXPECT_TRUE(all_close(gather(gdh, B, PC, rows), dhalo, 1e-5f, 1e-5f, "dhalo"));
        if (pad) {  // the rest of each row untouched
          for (std::int64_t r = 0; r < B; ++r)
            for (std::int64_t i = PC; i < rows; ++i) {
              ASSERT_EQ(gdh[r * rows + i], 7.f) << "dhalo row padding " << r;
            }
        }
        EXPECT_TRUE(all_close(to_host(d_dw), dw, 1e-5f, 1e-4f, "dw (accumulated)"));
        EXPECT_TRUE(all_close(to_host(d_db), db, 1e-5f, 1e-4f, "db (accumulated)"));

        // dx alone (no dhalo) and dhalo alone (no dx, dw, db): the same values.
        auto d_dx2 = to_device<float>(random_vector(B * T * C, 48));
        auto d_dhalo2 = to_device<float>(std::vector<float>(B * rows, 7.f));
        ops::cuda::causal_conv::depthwise_backward(d_x.get(), d_w.get(), extra, d_dy.get(), d_dx2.get(), nullptr,
                                                   nullptr, B, T, C, W, nullptr, d_halo.get(), nullptr, stride);
        ops::cuda::causal_conv::depthwise_backward(d_x.get(), d_w.get(), extra, d_dy.get(), nullptr, nullptr, nullptr,
                                                   B, T, C, W, nullptr, nullptr, d_dhalo2.get(), stride);
        EXPECT_TRUE(all_close(to_host(d_dx2), to_host(d_dx), 0.f, 0.f, "dx without dhalo"));
        EXPECT_TRUE(all_close(to_host(d_dhalo2), gdh, 0.f, 0.f, "dhalo alone"));
      }
    }
  }
}

// A halo of zeros gives exactly the results without one (y, dx, dw, db), and no halo (null)
// gives the existing results: the halo only replaces the zeros before time 0.
TEST(CausalConvCuda, DepthwiseHaloOfZerosEqualsNoHalo) {
  KEEL_REQUIRE_GPU();
  const std::int64_t B = 2, T = 9, C = 24;
  for (const int W : {2, 3}) {
    const int extra = 1;
    const std::int64_t To = T + extra, P = extra + W - 1;
    SCOPED_TRACE(testing::Message() << "W " << W);
    auto x = rounded_bf16(random_vector(B * T * C, 60));
    auto w = random_vector(C * W, 61), b = random_vector(C, 62, -0.3f, 0.3f), dy = random_vector(B * To * C, 63);
    auto d_x = to_device<cuda_bf16>(x), d_zero = to_device<cuda_bf16>(std::vector<float>(B * P * C, 0.f));
    auto d_w = to_device<float>(w), d_b = to_device<float>(b), d_dy = to_device<float>(dy);
    DeviceArray<cuda_bf16> d_y0(B * To * C), d_y1(B * To * C);
    DeviceArray<float> d_dx0(B * T * C), d_dx1(B * T * C), d_dw0(C * W), d_dw1(C * W), d_db0(C), d_db1(C),
        d_dhalo(B * P * C);
    ops::cuda::causal_conv::depthwise_forward(d_x.get(), d_w.get(), d_b.get(), extra, d_y0.get(), B, T, C, W, nullptr);
    ops::cuda::causal_conv::depthwise_forward(d_x.get(), d_w.get(), d_b.get(), extra, d_y1.get(), B, T, C, W, nullptr,
                                              d_zero.get());
    // dw and db sum row chunks with atomics (causal_conv.h): compared to fp32 rounding.
    ops::cuda::causal_conv::depthwise_backward(d_x.get(), d_w.get(), extra, d_dy.get(), d_dx0.get(), d_dw0.get(),
                                               d_db0.get(), B, T, C, W, nullptr);
    ops::cuda::causal_conv::depthwise_backward(d_x.get(), d_w.get(), extra, d_dy.get(), d_dx1.get(), d_dw1.get(),
                                               d_db1.get(), B, T, C, W, nullptr, d_zero.get(), d_dhalo.get());
    EXPECT_TRUE(all_close(to_host(d_y1), to_host(d_y0), 0.f, 0.f, "y"));
    EXPECT_TRUE(all_close(to_host(d_dx1), to_host(d_dx0), 0.f, 0.f, "dx"));
    EXPECT_TRUE(all_close(to_host(d_dw1), to_host(d_dw0), 1e-5f, 1e-5f, "dw"));
    EXPECT_TRUE(all_close(to_host(d_db1), to_host(d_db0), 1e-5f, 1e-5f, "db"));
  }
}

// The CPU test's B 2 and T 7 (ConvCase(2, 7, 6, 3, W0, W1) there); C 48 in groups of 24, the
// GEMM-friendly widths of GroupedGemmMatchesCpu (16-byte aligned head offsets).
struct HaloConv {
  std::int64_t B = 2, T = 7, C = 48, Cg = 24;
  int W0, W1;
  std::vector<float> x, w0, b0, w1, b1;
  HaloConv(int W0_, int W1_) : W0(W0_), W1(W1_) {
    x = rounded_bf16(random_vector(B * T * C, 70));
    w0 = random_vector(C * W0, 71, -0.8f, 0.8f);
    b0 = random_vector(C, 72, -0.3f, 0.3f);
    w1 = random_vector(C * Cg * W1, 73, -1.f / std::sqrt(float(Cg)), 1.f / std::sqrt(float(Cg)));
    b1 = random_vector(C, 74, -0.3f, 0.3f);
  }
};

// Depthwise (with an optional halo) then the tensor-core grouped conv on the GPU: x [B, T, C]
// -> mid [B, T + W1 - 1, C] bf16 -> y [B, T, C] fp32.
struct GpuConvOut {
  std::vector<float> mid, y;
};
GpuConvOut gpu_conv(const HaloConv& c, const std::vector<float>& x, std::int64_t T, const std::vector<float>* halo) {
  auto& gemm = ops::cuda::thread_gemm();
  const std::int64_t B = c.B, C = c.C, e = c.W1 - 1;
  auto d_x = to_device<cuda_bf16>(x);
  auto d_w0 = to_device<float>(c.w0), d_b0 = to_device<float>(c.b0), d_w1 = to_device<float>(c.w1),
       d_b1 = to_device<float>(c.b1);
  DeviceArray<cuda_bf16> d_halo, d_mid(B * (T + e) * C), d_wt(c.W1 * C * c.Cg);
  if (halo) d_halo = to_device<cuda_bf16>(*halo);
  DeviceArray<float> d_y(B * T * C);
  ops::cuda::causal_conv::depthwise_forward(d_x.get(), d_w0.get(), d_b0.get(), int(e), d_mid.get(), B, T, C, c.W0,
                                            nullptr, halo ? d_halo.get() : nullptr);
  ops::cuda::causal_conv::grouped_weights_bf16(d_w1.get(), d_wt.get(), C, c.Cg, c.W1, nullptr);
  ops::cuda::causal_conv::grouped_forward_gemm(gemm, d_mid.get(), d_wt.get(), d_b1.get(), d_y.get(), B, T, C, c.Cg,
                                               c.W1, nullptr);
  return {to_host(d_mid), to_host(d_y)};
}

// OpConv.HaloForwardMatchesWholeSequence on the GPU: a sequence split at p into part 1 (no halo)
// and part 2 (halo = part 1's last P = (W1-1) + (W0-1) inputs) gives the whole sequence's
// depthwise and grouped outputs; a zero halo instead changes part 2's first token.
TEST(CausalConvCuda, HaloForwardMatchesWholeSequence) {
  KEEL_REQUIRE_GPU();
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}, {2, 3}})
    for (std::int64_t p : {3, 4}) {
      SCOPED_TRACE(testing::Message() << "W0 " << W0 << " W1 " << W1 << " p " << p);
      HaloConv c(W0, W1);
      const std::int64_t B = c.B, T = c.T, C = c.C, e = W1 - 1, P = (W1 - 1) + (W0 - 1), T1 = p, T2 = T - p;
      const GpuConvOut whole = gpu_conv(c, c.x, T, nullptr);
      const auto x1 = take_rows(c.x, B, T, C, 0, T1), x2 = take_rows(c.x, B, T, C, p, T2);
      const auto halo = take_rows(c.x, B, T, C, p - P, P);
      const GpuConvOut part1 = gpu_conv(c, x1, T1, nullptr), part2 = gpu_conv(c, x2, T2, &halo);
      // The depthwise rows of part 2 (its times -e .. T2-1) are the whole sequence's times
      // p-e .. T-1 (the same fp32 operations; compared to bf16 rounding as DepthwiseMatchesCpu).
      EXPECT_TRUE(all_close(part2.mid, take_rows(whole.mid, B, T + e, C, p, T2 + e), 4e-3f, 1e-5f, "part 2 depthwise"));
      EXPECT_TRUE(all_close(part1.mid, take_rows(whole.mid, B, T + e, C, 0, T1 + e), 4e-3f, 1e-5f, "part 1 depthwise"));
      EXPECT_TRUE(all_close(part1.y, take_rows(whole.y, B, T, C, 0, T1), 1e-4f, 1e-4f, "part 1 y"));
      EXPECT_TRUE(all_close(part2.y, take_rows(whole.y, B, T, C, p, T2), 1e-4f, 1e-4f, "part 2 y"));
      // The halo matters: zeros instead give another result at part 2's first token.
      const std::vector<float> zeros(B * P * C, 0.f);
      const GpuConvOut zero = gpu_conv(c, x2, T2, &zeros);
      double diff = 0;
      for (std::int64_t ch = 0; ch < C; ++ch) diff += std::abs(zero.y[ch] - part2.y[ch]);
      EXPECT_GT(diff, 1e-3);
    }
}

// OpConv.HaloBackwardMatchesWholeSequence for the depthwise conv on the GPU: part 1's dx plus
// part 2's dhalo (the gradient of part 1's last P rows) and part 2's dx give the whole
// sequence's dx; dw, db accumulated over both parts give the whole sequence's.
TEST(CausalConvCuda, HaloBackwardMatchesWholeSequence) {
  KEEL_REQUIRE_GPU();
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}, {2, 3}})
    for (std::int64_t p : {3, 4}) {
      SCOPED_TRACE(testing::Message() << "W0 " << W0 << " W1 " << W1 << " p " << p);
      HaloConv c(W0, W1);
      const std::int64_t B = c.B, T = c.T, C = c.C, e = W1 - 1, P = (W1 - 1) + (W0 - 1), T1 = p, T2 = T - p;
      const int W = W0;
      const auto dmid = random_vector(B * (T + e) * C, 75);
      // The whole sequence.
      auto d_x = to_device<cuda_bf16>(c.x);
      auto d_w = to_device<float>(c.w0), d_dmid = to_device<float>(dmid);
      DeviceArray<float> d_dx(B * T * C), d_dw(C * W), d_db(C);
      ops::cuda::causal_conv::depthwise_backward(d_x.get(), d_w.get(), int(e), d_dmid.get(), d_dx.get(), d_dw.get(),
                                                 d_db.get(), B, T, C, W, nullptr);
      // Whole depthwise row j is time j - e. Part 1's rows are the whole's rows 0 .. T1+e-1,
      // part 2's (its times -e .. T2-1) the whole's rows p .. T+e-1: the e rows T1 .. T1+e-1
      // (times p-e .. p-1) are computed by both parts (part 2 from its halo), so their gradient
      // goes to one of them, part 2, and part 1's copy of them is zero. dw, db accumulate over
      // both parts into one pair of buffers.
      const auto x1 = take_rows(c.x, B, T, C, 0, T1), x2 = take_rows(c.x, B, T, C, p, T2);
      const auto halo = take_rows(c.x, B, T, C, p - P, P);
      auto dm1 = take_rows(dmid, B, T + e, C, 0, T1 + e), dm2 = take_rows(dmid, B, T + e, C, p, T2 + e);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t r = T1; r < T1 + e; ++r)
          for (std::int64_t ch = 0; ch < C; ++ch) dm1[(b * (T1 + e) + r) * C + ch] = 0.f;
      auto d_x1 = to_device<cuda_bf16>(x1), d_x2 = to_device<cuda_bf16>(x2), d_halo = to_device<cuda_bf16>(halo);
      auto d_dm1 = to_device<float>(dm1), d_dm2 = to_device<float>(dm2);
      DeviceArray<float> d_dx1(B * T1 * C), d_dx2(B * T2 * C), d_sw(C * W), d_sb(C);
      auto d_dhalo = to_device<float>(std::vector<float>(B * P * C, 7.f));
      ops::cuda::causal_conv::depthwise_backward(d_x1.get(), d_w.get(), int(e), d_dm1.get(), d_dx1.get(), d_sw.get(),
                                                 d_sb.get(), B, T1, C, W, nullptr);
      ops::cuda::causal_conv::depthwise_backward(d_x2.get(), d_w.get(), int(e), d_dm2.get(), d_dx2.get(), d_sw.get(),
                                                 d_sb.get(), B, T2, C, W, nullptr, d_halo.get(), d_dhalo.get());
      auto dx1 = to_host(d_dx1);
      const auto dhalo = to_host(d_dhalo);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t i = 0; i < P * C; ++i) dx1[(b * T1 + T1 - P) * C + i] += dhalo[b * P * C + i];
      const auto dx = to_host(d_dx);
      EXPECT_TRUE(all_close(dx1, take_rows(dx, B, T, C, 0, T1), 1e-5f, 1e-5f, "dx part 1 (+ dhalo)"));
      EXPECT_TRUE(all_close(to_host(d_dx2), take_rows(dx, B, T, C, p, T2), 1e-5f, 1e-5f, "dx part 2"));
      EXPECT_TRUE(all_close(to_host(d_sw), to_host(d_dw), 1e-5f, 1e-4f, "dw"));
      EXPECT_TRUE(all_close(to_host(d_sb), to_host(d_db), 1e-5f, 1e-4f, "db"));
    }
}

TEST(CausalConvCuda, RejectsABadHaloStride) {
  KEEL_REQUIRE_GPU();
  // P = extra + W - 1 = 2 rows of C = 10: a stride below 20 elements is refused before launching.
  EXPECT_THROW(ops::cuda::causal_conv::depthwise_forward(nullptr, nullptr, nullptr, 1, nullptr, 1, 4, 10, 2, nullptr,
                                                         nullptr, 19),
               Error);
  EXPECT_THROW(ops::cuda::causal_conv::depthwise_backward(nullptr, nullptr, 1, nullptr, nullptr, nullptr, nullptr, 1, 4,
                                                          10, 2, nullptr, nullptr, nullptr, 19),
               Error);
}

}  // namespace
}  // namespace keel

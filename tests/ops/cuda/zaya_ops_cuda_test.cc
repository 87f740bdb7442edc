// The ZAYA1 CUDA ops against their CPU references (src/ops) on fresh random inputs rounded to
// bf16: residual scaling, the causal convolutions, the MLP router (EDA, top-1, skip class) and
// the CCA block. Shapes are small and odd (T not a multiple of any tile, two sequences, group
// widths that are not multiples of the conv tiles) plus the ZAYA1-tiny dims (hidden 256, 4 q
// heads x 64, 2 kv heads, conv widths 2, router width 256 with 17 classes).
// Tolerances: fp32 paths to fp32 rounding (sums in a different order); paths through bf16
// intermediates norm-relative (||got - want|| / ||want||), since the CPU keeps fp32 there.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/causal_conv.h"
#include "ops/cca.h"
#include "ops/cuda/causal_conv.h"
#include "ops/cuda/cca.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/residual_scale.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/zaya_router.h"
#include "ops/residual_scale.h"
#include "ops/rope.h"
#include "ops/zaya_router.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

using cuda_bf16 = __nv_bfloat16;
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
using test::download_bf16;
using test::download_f32;
using test::download_raw;
using test::logged_rel_err;
using test::upload_raw;


// ---------------------------------------------------------------- residual scaling

TEST(ResidualScaleCuda, ForwardAndBackwardMatchCpu) {
  KEEL_REQUIRE_GPU();
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{37, 200}, {300, 7}, {1, 1}, {96, 2048}};
  for (const auto& [rows, dim] : shapes) {
    SCOPED_TRACE(testing::Message() << "rows " << rows << " dim " << dim);
    const std::int64_t n = rows * dim;
    auto x = random_vector(n, 1), b = random_vector(dim, 2, -0.5f, 0.5f), s = random_vector(dim, 3, 0.5f, 1.5f);
    auto dy = random_vector(n, 4), db0 = random_vector(dim, 5), ds0 = random_vector(dim, 6);
    std::vector<float> y(n), dx(n), db = db0, ds = ds0;
    ops::residual_scale::forward(Tensor(x.data(), {rows, dim}), Tensor(b.data(), {dim}), Tensor(s.data(), {dim}),
                                 Tensor(y.data(), {rows, dim}));
    ops::residual_scale::backward(Tensor(x.data(), {rows, dim}), Tensor(b.data(), {dim}), Tensor(s.data(), {dim}),
                                  Tensor(dy.data(), {rows, dim}), Tensor(dx.data(), {rows, dim}),
                                  Tensor(db.data(), {dim}), Tensor(ds.data(), {dim}));

    auto d_x = to_device<float>(x), d_b = to_device<float>(b), d_s = to_device<float>(s), d_dy = to_device<float>(dy);
    auto d_db = to_device<float>(db0), d_ds = to_device<float>(ds0);
    DeviceArray<float> d_y(n);
    ops::cuda::residual_scale::forward(d_x.get(), d_b.get(), d_s.get(), d_y.get(), rows, dim, nullptr);
    EXPECT_TRUE(all_close(to_host(d_y), y, 1e-6f, 1e-6f, "y"));
    // In place (y aliases x), and dx aliasing dy.
    ops::cuda::residual_scale::forward(d_x.get(), d_b.get(), d_s.get(), d_x.get(), rows, dim, nullptr);
    EXPECT_TRUE(all_close(to_host(d_x), y, 1e-6f, 1e-6f, "y in place"));
    auto d_x2 = to_device<float>(x);
    ops::cuda::residual_scale::backward(d_x2.get(), d_b.get(), d_s.get(), d_dy.get(), d_dy.get(), d_db.get(),
                                        d_ds.get(), rows, dim, nullptr);
    EXPECT_TRUE(all_close(to_host(d_dy), dx, 1e-6f, 1e-6f, "dx (aliasing dy)"));
    EXPECT_TRUE(all_close(to_host(d_db), db, 1e-5f, 1e-4f, "db (accumulated)"));
    EXPECT_TRUE(all_close(to_host(d_ds), ds, 1e-5f, 1e-4f, "ds (accumulated)"));
  }
}

// dim 130: the element-wise backward kernel; 256: 4 columns per thread (vector accesses).
void expect_merge_matches_cpu(std::int64_t rows, std::int64_t dim) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " dim " << dim);
  const std::int64_t n = rows * dim;
  auto r = random_vector(n, 11), h = rounded_bf16(random_vector(n, 12));
  auto b_r = random_vector(dim, 13, -0.3f, 0.3f), s_r = random_vector(dim, 14, 0.5f, 1.5f);
  auto b_h = random_vector(dim, 15, -0.3f, 0.3f), s_h = random_vector(dim, 16, 0.5f, 1.5f);
  auto dout = random_vector(n, 17);
  std::vector<std::vector<float>> g0 = {random_vector(dim, 18), random_vector(dim, 19), random_vector(dim, 20),
                                        random_vector(dim, 21)};  // db_r ds_r db_h ds_h
  auto T1 = [dim](std::vector<float>& v) { return Tensor(v.data(), {dim}); };
  auto T2 = [rows, dim](std::vector<float>& v) { return Tensor(v.data(), {rows, dim}); };
  std::vector<float> out(n), dr(n), dh(n);
  auto g = g0;
  ops::residual_scale::merge_forward(T2(r), T2(h), T1(b_r), T1(s_r), T1(b_h), T1(s_h), T2(out));
  ops::residual_scale::merge_backward(T2(r), T2(h), T1(b_r), T1(s_r), T1(b_h), T1(s_h), T2(dout), T2(dr), T2(dh),
                                      T1(g[0]), T1(g[1]), T1(g[2]), T1(g[3]));

  auto d_b_r = to_device<float>(b_r), d_s_r = to_device<float>(s_r), d_b_h = to_device<float>(b_h),
       d_s_h = to_device<float>(s_h);
  for (const bool bf16_h : {true, false}) {
    SCOPED_TRACE(bf16_h ? "bf16 h" : "fp32 h");
    auto d_r = to_device<float>(r), d_dout = to_device<float>(dout);
    auto d_hb = to_device<cuda_bf16>(h);
    auto d_hf = to_device<float>(h);
    DeviceArray<cuda_bf16> d_dhb(n);
    DeviceArray<float> d_dhf(n);
    std::vector<DeviceArray<float>> d_g;
    for (auto& v : g0) d_g.push_back(to_device<float>(v));
    // out aliases r (in-place residual), dr aliases dout (in-place residual gradient).
    if (bf16_h) {
      ops::cuda::residual_scale::merge_forward(d_r.get(), d_hb.get(), d_b_r.get(), d_s_r.get(), d_b_h.get(),
                                               d_s_h.get(), d_r.get(), rows, dim, nullptr);
      auto d_r2 = to_device<float>(r);
      ops::cuda::residual_scale::merge_backward(d_r2.get(), d_hb.get(), d_b_r.get(), d_s_r.get(), d_b_h.get(),
                                                d_s_h.get(), d_dout.get(), d_dout.get(), d_dhb.get(), d_g[0].get(),
                                                d_g[1].get(), d_g[2].get(), d_g[3].get(), rows, dim, nullptr);
      EXPECT_TRUE(all_close(to_host(d_dhb), dh, 4e-3f, 1e-6f, "dh (bf16)"));
    } else {
      ops::cuda::residual_scale::merge_forward(d_r.get(), d_hf.get(), d_b_r.get(), d_s_r.get(), d_b_h.get(),
                                               d_s_h.get(), d_r.get(), rows, dim, nullptr);
      auto d_r2 = to_device<float>(r);
      ops::cuda::residual_scale::merge_backward(d_r2.get(), d_hf.get(), d_b_r.get(), d_s_r.get(), d_b_h.get(),
                                                d_s_h.get(), d_dout.get(), d_dout.get(), d_dhf.get(), d_g[0].get(),
                                                d_g[1].get(), d_g[2].get(), d_g[3].get(), rows, dim, nullptr);
      EXPECT_TRUE(all_close(to_host(d_dhf), dh, 1e-6f, 1e-6f, "dh (fp32)"));
    }
    EXPECT_TRUE(all_close(to_host(d_r), out, 1e-5f, 1e-5f, "out (aliasing r)"));
    EXPECT_TRUE(all_close(to_host(d_dout), dr, 1e-6f, 1e-6f, "dr (aliasing dout)"));
    const char* names[] = {"db_r", "ds_r", "db_h", "ds_h"};
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(all_close(to_host(d_g[i]), g[i], 1e-5f, 1e-4f, names[i]));
  }
  // Skipped outputs (null): dh, ds_r and db_h are not computed, the rest as above.
  auto d_r = to_device<float>(r), d_hf = to_device<float>(h), d_dout = to_device<float>(dout);
  DeviceArray<float> d_dr(n);
  auto d_db_r = to_device<float>(g0[0]), d_ds_h = to_device<float>(g0[3]);
  ops::cuda::residual_scale::merge_backward(d_r.get(), d_hf.get(), d_b_r.get(), d_s_r.get(), d_b_h.get(), d_s_h.get(),
                                            d_dout.get(), d_dr.get(), static_cast<float*>(nullptr), d_db_r.get(),
                                            nullptr, nullptr, d_ds_h.get(), rows, dim, nullptr);
  EXPECT_TRUE(all_close(to_host(d_dr), dr, 1e-6f, 1e-6f, "dr (others skipped)"));
  EXPECT_TRUE(all_close(to_host(d_db_r), g[0], 1e-5f, 1e-4f, "db_r (others skipped)"));
  EXPECT_TRUE(all_close(to_host(d_ds_h), g[3], 1e-5f, 1e-4f, "ds_h (others skipped)"));
  EXPECT_TRUE(all_close(to_host(d_dout), dout, 0.f, 0.f, "dout unchanged"));
}

TEST(ResidualScaleCuda, MergeMatchesCpuForBf16AndFp32Branches) {
  KEEL_REQUIRE_GPU();
  expect_merge_matches_cpu(75, 130);
  expect_merge_matches_cpu(75, 256);
}

// ---------------------------------------------------------------- causal convolutions

TEST(CausalConvCuda, DepthwiseMatchesCpu) {
  KEEL_REQUIRE_GPU();
  const std::int64_t B = 2, T = 37, C = 40;
  for (const int W : {1, 2, 3}) {
    for (const int extra : {0, 1, 2}) {
      SCOPED_TRACE(testing::Message() << "W " << W << " extra " << extra);
      const std::int64_t To = T + extra;
      auto x = rounded_bf16(random_vector(B * T * C, 30 + W));
      auto w = random_vector(C * W, 31), b = random_vector(C, 32, -0.3f, 0.3f);
      auto dy = random_vector(B * To * C, 33), dw0 = random_vector(C * W, 34), db0 = random_vector(C, 35);
      std::vector<float> y(B * To * C), dx(B * T * C), dw = dw0, db = db0;
      ops::causal_conv::depthwise_forward(Tensor(x.data(), {B, T, C}), Tensor(w.data(), {C, W}), Tensor(b.data(), {C}),
                                          extra, Tensor(y.data(), {B, To, C}));
      ops::causal_conv::depthwise_backward(Tensor(x.data(), {B, T, C}), Tensor(w.data(), {C, W}), extra,
                                           Tensor(dy.data(), {B, To, C}), Tensor(dx.data(), {B, T, C}),
                                           Tensor(dw.data(), {C, W}), Tensor(db.data(), {C}));
      auto d_x = to_device<cuda_bf16>(x);
      auto d_w = to_device<float>(w), d_b = to_device<float>(b), d_dy = to_device<float>(dy);
      auto d_dw = to_device<float>(dw0), d_db = to_device<float>(db0);
      DeviceArray<cuda_bf16> d_y(B * To * C);
      DeviceArray<float> d_dx(B * T * C);
      ops::cuda::causal_conv::depthwise_forward(d_x.get(), d_w.get(), d_b.get(), extra, d_y.get(), B, T, C, W, nullptr);
      ops::cuda::causal_conv::depthwise_backward(d_x.get(), d_w.get(), extra, d_dy.get(), d_dx.get(), d_dw.get(),
                                                 d_db.get(), B, T, C, W, nullptr);
      EXPECT_TRUE(all_close(to_host(d_y), y, 4e-3f, 1e-5f, "y (bf16)"));
      EXPECT_TRUE(all_close(to_host(d_dx), dx, 1e-5f, 1e-5f, "dx"));
      EXPECT_TRUE(all_close(to_host(d_dw), dw, 1e-5f, 1e-4f, "dw (accumulated)"));
      EXPECT_TRUE(all_close(to_host(d_db), db, 1e-5f, 1e-4f, "db (accumulated)"));
    }
  }
}

struct GroupedCase {
  std::int64_t B, T, C, Cg;
  int W;
};

// The tensor-core grouped conv (CCA's layout, lead = W - 1) against the CPU op given the same
// bf16-rounded weights and dy the GEMMs take: then only the fp32 accumulation order differs.
// Also checked against the CPU op on the fp32 weights, to the bf16 rounding of the weights.
TEST(CausalConvCuda, GroupedGemmMatchesCpu) {
  KEEL_REQUIRE_GPU();
  auto& gemm = ops::cuda::thread_gemm();
  // Cg 40 and 24 (head offsets of 80 and 48 bytes); Cg 128 x 10 with 2 sequences: ZAYA1's
  // grouped conv; W 3 (two padding rows between sequences); odd lengths; a single token.
  for (const GroupedCase k : {GroupedCase{2, 37, 120, 40, 2}, GroupedCase{3, 37, 120, 40, 3},
                              GroupedCase{1, 70, 72, 24, 2}, GroupedCase{2, 45, 1280, 128, 2},
                              GroupedCase{2, 1, 64, 64, 3}, GroupedCase{4, 9, 256, 128, 1}}) {
    SCOPED_TRACE(testing::Message() << "B " << k.B << " T " << k.T << " C " << k.C << " Cg " << k.Cg << " W " << k.W);
    const std::int64_t B = k.B, T = k.T, C = k.C, Cg = k.Cg, W = k.W, Ti = T + W - 1;
    auto x = rounded_bf16(random_vector(B * Ti * C, 50));
    auto w = random_vector(C * Cg * W, 51, -1.f / std::sqrt(float(Cg)), 1.f / std::sqrt(float(Cg)));
    auto wr = rounded_bf16(w);
    auto b = random_vector(C, 52, -0.3f, 0.3f), dy = rounded_bf16(random_vector(B * T * C, 53));
    auto dw0 = random_vector(C * Cg * W, 54), db0 = random_vector(C, 55);
    auto cpu = [&](std::vector<float>& wv, std::vector<float>& y, std::vector<float>& dx, std::vector<float>& dw,
                   std::vector<float>& db) {
      y.assign(B * T * C, 0.f), dx.assign(B * Ti * C, 0.f), dw = dw0, db = db0;
      ops::causal_conv::grouped_forward(Tensor(x.data(), {B, Ti, C}), Tensor(wv.data(), {C, Cg, W}),
                                        Tensor(b.data(), {C}), int(W - 1), Tensor(y.data(), {B, T, C}));
      ops::causal_conv::grouped_backward(Tensor(x.data(), {B, Ti, C}), Tensor(wv.data(), {C, Cg, W}), int(W - 1),
                                         Tensor(dy.data(), {B, T, C}), Tensor(dx.data(), {B, Ti, C}),
                                         Tensor(dw.data(), {C, Cg, W}), Tensor(db.data(), {C}));
    };
    std::vector<float> y, dx, dw, db, y32, dx32, dw32, db32;
    cpu(wr, y, dx, dw, db);
    cpu(w, y32, dx32, dw32, db32);

    auto d_x = to_device<cuda_bf16>(x);
    auto d_w = to_device<float>(w), d_b = to_device<float>(b), d_dy = to_device<float>(dy);
    auto d_dw = to_device<float>(dw0), d_db = to_device<float>(db0);
    DeviceArray<cuda_bf16> d_wt(W * C * Cg);
    // Non-zero garbage in the outputs and scratch: both are overwritten, never read first.
    auto d_y = to_device<float>(random_vector(B * T * C, 56)), d_dx = to_device<float>(random_vector(B * Ti * C, 57));
    const std::size_t ws = ops::cuda::causal_conv::grouped_backward_gemm_scratch_bytes(B, T, C, Cg, int(W));
    auto d_ws = to_device<float>(random_vector(std::int64_t(ws / sizeof(float)), 58));
    ops::cuda::causal_conv::grouped_weights_bf16(d_w.get(), d_wt.get(), C, Cg, int(W), nullptr);
    ops::cuda::causal_conv::grouped_forward_gemm(gemm, d_x.get(), d_wt.get(), d_b.get(), d_y.get(), B, T, C, Cg,
                                                 int(W), nullptr);
    ops::cuda::causal_conv::grouped_backward_gemm(gemm, d_x.get(), d_wt.get(), d_dy.get(), d_dx.get(), d_dw.get(),
                                                  d_db.get(), B, T, C, Cg, int(W), d_ws.get(), nullptr);
    const auto gy = to_host(d_y), gdx = to_host(d_dx), gdw = to_host(d_dw), gdb = to_host(d_db);
    EXPECT_TRUE(all_close(gy, y, 1e-4f, 1e-4f, "y"));
    EXPECT_TRUE(all_close(gdx, dx, 1e-4f, 1e-4f, "dx"));
    EXPECT_TRUE(all_close(gdw, dw, 1e-4f, 2e-4f, "dw (accumulated)"));
    EXPECT_TRUE(all_close(gdb, db, 1e-4f, 2e-4f, "db (accumulated)"));
    EXPECT_LT(norm_rel_err(gy, y32), 5e-3) << "y against fp32 weights";
    EXPECT_LT(norm_rel_err(gdx, dx32), 5e-3) << "dx against fp32 weights";
  }
}

TEST(CausalConvCuda, RejectsBadShapes) {
  KEEL_REQUIRE_GPU();
  EXPECT_THROW(ops::cuda::causal_conv::grouped_forward_gemm(ops::cuda::thread_gemm(), nullptr, nullptr, nullptr,
                                                            nullptr, 1, 4, 10, 3, 2, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::causal_conv::depthwise_forward(nullptr, nullptr, nullptr, 0, nullptr, 1, 4, 10,
                                                         ops::cuda::causal_conv::kMaxWidth + 1, nullptr),
               Error);
}

// ---------------------------------------------------------------- ZAYA router

struct RouterCase {
  std::int64_t N, H, D;
  int E;
  bool eda;
  float aux = 0.f;  // the aux loss's weight in backward (large enough to matter beside dgates)
};

TEST(ZayaRouterCuda, ForwardAndBackwardMatchCpu) {
  KEEL_REQUIRE_GPU();
  namespace zr = ops::zaya_router;
  namespace kzr = ops::cuda::zaya_router;
  auto& gemm = ops::cuda::thread_gemm();
  for (const RouterCase rc : {RouterCase{74, 256, 256, 17, true}, RouterCase{74, 256, 256, 17, false},
                              RouterCase{37, 96, 48, 5, true}, RouterCase{74, 256, 256, 17, true, 20.f}}) {
    SCOPED_TRACE(testing::Message() << "N " << rc.N << " H " << rc.H << " D " << rc.D << " E " << rc.E
                                    << (rc.eda ? " EDA" : " no EDA") << " aux " << rc.aux);
    const std::int64_t N = rc.N, H = rc.H, D = rc.D, E = rc.E;
    const float eps = 1e-5f, sh = 1.f / std::sqrt(float(H)), sd = 1.f / std::sqrt(float(D));
    // Parameters: GEMM weights rounded to bf16 (the GPU uses exactly these), the rest fp32.
    // order: w_down b_down gamma w_norm w1 b1 w2 b2 w3
    std::vector<std::vector<float>> p = {
        rounded_bf16(random_vector(D * H, 50, -sh, sh)), random_vector(D, 51, -0.1f, 0.1f),
        random_vector(D, 52, 0.5f, 1.5f),               random_vector(D, 53, 0.7f, 1.3f),
        rounded_bf16(random_vector(D * D, 54, -sd, sd)), random_vector(D, 55, -0.2f, 0.2f),
        rounded_bf16(random_vector(D * D, 56, -sd, sd)), random_vector(D, 57, -0.2f, 0.2f),
        rounded_bf16(random_vector(E * D, 58, -4 * sd, 4 * sd))};
    auto x = rounded_bf16(random_vector(N * H, 60));
    auto prev = random_vector(N * D, 61);
    auto bias = random_vector(E, 62, -0.05f, 0.05f);
    auto view = [&](std::vector<std::vector<float>>& v) {
      zr::Params q;
      q.w_down = Tensor(v[0].data(), {D, H});
      q.b_down = Tensor(v[1].data(), {D});
      q.gamma = Tensor(v[2].data(), {D});
      q.w_norm = Tensor(v[3].data(), {D});
      q.w1 = Tensor(v[4].data(), {D, D});
      q.b1 = Tensor(v[5].data(), {D});
      q.w2 = Tensor(v[6].data(), {D, D});
      q.b2 = Tensor(v[7].data(), {D});
      q.w3 = Tensor(v[8].data(), {E, D});
      return q;
    };
    const Tensor prev_t = rc.eda ? Tensor(prev.data(), {N, D}) : Tensor();
    std::vector<float> saved_buf(zr::saved_floats(N, D, E));
    zr::Saved cs = zr::carve_saved(saved_buf.data(), N, D, E);
    zr::forward(Tensor(x.data(), {N, H}), prev_t, view(p), Tensor(bias.data(), {E}), eps, cs);

    // GPU forward.
    std::vector<DeviceArray<float>> d_pf;  // fp32 copies of every parameter
    for (auto& v : p) d_pf.push_back(to_device<float>(v));
    auto d_w_down = to_device<cuda_bf16>(p[0]), d_w1 = to_device<cuda_bf16>(p[4]), d_w2 = to_device<cuda_bf16>(p[6]),
         d_w3 = to_device<cuda_bf16>(p[8]);
    kzr::Weights w;
    w.w_down = d_w_down.get();
    w.b_down = d_pf[1].get();
    w.gamma = rc.eda ? d_pf[2].get() : nullptr;
    w.w_norm = d_pf[3].get();
    w.w1 = d_w1.get();
    w.b1 = d_pf[5].get();
    w.w2 = d_w2.get();
    w.b2 = d_pf[7].get();
    w.w3 = d_w3.get();
    kzr::Dims dims;
    dims.tokens = N, dims.hidden = H, dims.dim = D, dims.classes = rc.E, dims.eps = eps;
    auto d_x = to_device<cuda_bf16>(x);
    auto d_prev = to_device<float>(prev), d_bias = to_device<float>(bias);
    DeviceArray<unsigned char> d_saved(kzr::saved_bytes(dims));
    const kzr::Saved s = kzr::carve_saved(dims, d_saved.get());
    kzr::forward(gemm, dims, d_x.get(), rc.eda ? d_prev.get() : nullptr, w, d_bias.get(), s, nullptr);

    const auto state = download_f32(s.state, N * D), probs = download_f32(s.probs, N * E),
               gates = download_f32(s.gates, N);
    const auto idx = download_raw(s.idx, N);
    const auto counts = download_raw(s.counts, E);
    EXPECT_LT(norm_rel_err(state, std::vector<float>(cs.state.data(), cs.state.data() + N * D)), 1e-5) << "state";
    EXPECT_LT(logged_rel_err("probs", probs, std::vector<float>(cs.probs.data(), cs.probs.data() + N * E)), 2e-2) << "probs";
    // Selection: identical wherever the CPU's biased top-2 gap is not a near tie that bf16
    // intermediates could flip; gates are the chosen probabilities; counts its histogram.
    std::vector<std::int32_t> hist(E, 0);
    int flips = 0;
    for (std::int64_t n = 0; n < N; ++n) {
      float best = -1e30f, second = -1e30f;
      for (std::int64_t e = 0; e < E; ++e) {
        const float sc = cs.probs.data()[n * E + e] + bias[e];
        if (sc > best) second = best, best = sc;
        else if (sc > second) second = sc;
      }
      if (idx[n] != cs.idx[n]) {
        ++flips;
        EXPECT_LT(best - second, 1e-2f) << "token " << n << " picked " << idx[n] << ", CPU " << cs.idx[n];
      }
      ASSERT_GE(idx[n], 0);
      ASSERT_LT(idx[n], E);
      ++hist[idx[n]];
      EXPECT_EQ(gates[n], probs[n * E + idx[n]]) << "token " << n;
    }
    EXPECT_LE(flips, N / 8);
    EXPECT_EQ(counts, hist);

    // Backward. The CPU replays the GPU's selection so both differentiate the same gates.
    for (std::int64_t n = 0; n < N; ++n) {
      cs.idx[n] = idx[n];
      cs.gates[n] = cs.probs.data()[n * E + idx[n]];
    }
    std::fill(cs.counts.begin(), cs.counts.end(), 0);
    for (std::int64_t n = 0; n < N; ++n) ++cs.counts[idx[n]];
    auto dgates = random_vector(N, 63), dstate_next = random_vector(N * D, 64, -0.2f, 0.2f);
    std::vector<std::vector<float>> g0;
    for (std::size_t i = 0; i < p.size(); ++i) g0.push_back(random_vector(p[i].size(), 70 + i, -0.1f, 0.1f));
    auto g = g0;
    std::vector<float> dx(N * H), dprev(N * D), scratch(zr::backward_scratch_floats(N, D, E));
    zr::backward(Tensor(x.data(), {N, H}), prev_t, view(p), cs, Tensor(dgates.data(), {N, 1}),
                 Tensor(dstate_next.data(), {N, D}), Tensor(dx.data(), {N, H}),
                 rc.eda ? Tensor(dprev.data(), {N, D}) : Tensor(), view(g), Tensor(scratch.data(), {std::int64_t(scratch.size())}),
                 rc.aux);

    std::vector<DeviceArray<float>> d_g;
    for (auto& v : g0) d_g.push_back(to_device<float>(v));
    kzr::Grads gr;
    gr.w_down = d_g[0].get(), gr.b_down = d_g[1].get(), gr.gamma = d_g[2].get(), gr.w_norm = d_g[3].get();
    gr.w1 = d_g[4].get(), gr.b1 = d_g[5].get(), gr.w2 = d_g[6].get(), gr.b2 = d_g[7].get(), gr.w3 = d_g[8].get();
    auto d_dgates = to_device<float>(dgates), d_dnext = to_device<float>(dstate_next);
    DeviceArray<cuda_bf16> d_dx(N * H);
    DeviceArray<float> d_dprev(N * D);
    DeviceArray<unsigned char> d_scratch(kzr::backward_scratch_bytes(dims));
    kzr::backward(gemm, dims, d_x.get(), rc.eda ? d_prev.get() : nullptr, w, s, d_dgates.get(), d_dnext.get(),
                  d_dx.get(), rc.eda ? d_dprev.get() : nullptr, gr, d_scratch.get(), nullptr, rc.aux);
    EXPECT_LT(logged_rel_err("dx", to_host(d_dx), dx), 3e-2) << "dx";
    if (rc.eda) {
      EXPECT_LT(logged_rel_err("dprev_state", to_host(d_dprev), dprev), 3e-2) << "dprev_state";
    }
    const char* names[] = {"w_down", "b_down", "gamma", "w_norm", "w1", "b1", "w2", "b2", "w3"};
    for (std::size_t i = 0; i < p.size(); ++i) {
      const auto got = minus(to_host(d_g[i]), g0[i]), want = minus(g[i], g0[i]);
      if (i == 2 && !rc.eda) {
        EXPECT_TRUE(all_close(got, want, 0.f, 0.f, "gamma untouched without EDA"));
        continue;
      }
      EXPECT_LT(logged_rel_err(names[i], got, want), 3e-2) << names[i];
    }
  }
}

// Forced balance (benchmarking) with the skip class on: both twins send token n to expert
// n mod (E - 1) whatever the scores and the bias (set to favour skip), so no token skips and
// indices and counts match the CPU op exactly; gates are the chosen probabilities.
TEST(ZayaRouterCuda, ForcedBalanceMatchesCpu) {
  KEEL_REQUIRE_GPU();
  namespace zr = ops::zaya_router;
  namespace kzr = ops::cuda::zaya_router;
  auto& gemm = ops::cuda::thread_gemm();
  const std::int64_t N = 80, H = 96, D = 48, E = 17;  // 16 experts + skip
  const int experts = int(E - 1);
  const float eps = 1e-5f, sh = 1.f / std::sqrt(float(H)), sd = 1.f / std::sqrt(float(D));
  // order: w_down b_down gamma w_norm w1 b1 w2 b2 w3 (gamma unused: no EDA)
  std::vector<std::vector<float>> p = {
      rounded_bf16(random_vector(D * H, 80, -sh, sh)), random_vector(D, 81, -0.1f, 0.1f),
      random_vector(D, 82, 0.5f, 1.5f),               random_vector(D, 83, 0.7f, 1.3f),
      rounded_bf16(random_vector(D * D, 84, -sd, sd)), random_vector(D, 85, -0.2f, 0.2f),
      rounded_bf16(random_vector(D * D, 86, -sd, sd)), random_vector(D, 87, -0.2f, 0.2f),
      rounded_bf16(random_vector(E * D, 88, -4 * sd, 4 * sd))};
  auto x = rounded_bf16(random_vector(N * H, 89));
  std::vector<float> bias(E, 0.f);
  bias[E - 1] = 2.f;  // unforced, every token would skip
  zr::Params q;
  q.w_down = Tensor(p[0].data(), {D, H});
  q.b_down = Tensor(p[1].data(), {D});
  q.w_norm = Tensor(p[3].data(), {D});
  q.w1 = Tensor(p[4].data(), {D, D});
  q.b1 = Tensor(p[5].data(), {D});
  q.w2 = Tensor(p[6].data(), {D, D});
  q.b2 = Tensor(p[7].data(), {D});
  q.w3 = Tensor(p[8].data(), {E, D});
  std::vector<float> saved_buf(zr::saved_floats(N, D, E));
  zr::Saved cs = zr::carve_saved(saved_buf.data(), N, D, E);
  zr::forward(Tensor(x.data(), {N, H}), Tensor(), q, Tensor(bias.data(), {E}), eps, cs, experts);

  std::vector<DeviceArray<float>> d_pf;
  for (auto& v : p) d_pf.push_back(to_device<float>(v));
  auto d_w_down = to_device<cuda_bf16>(p[0]), d_w1 = to_device<cuda_bf16>(p[4]), d_w2 = to_device<cuda_bf16>(p[6]),
       d_w3 = to_device<cuda_bf16>(p[8]);
  kzr::Weights w;
  w.w_down = d_w_down.get(), w.b_down = d_pf[1].get(), w.w_norm = d_pf[3].get();
  w.w1 = d_w1.get(), w.b1 = d_pf[5].get(), w.w2 = d_w2.get(), w.b2 = d_pf[7].get(), w.w3 = d_w3.get();
  kzr::Dims dims;
  dims.tokens = N, dims.hidden = H, dims.dim = D, dims.classes = int(E), dims.eps = eps, dims.forced_classes = experts;
  auto d_x = to_device<cuda_bf16>(x);
  auto d_bias = to_device<float>(bias);
  DeviceArray<unsigned char> d_saved(kzr::saved_bytes(dims));
  const kzr::Saved s = kzr::carve_saved(dims, d_saved.get());
  kzr::forward(gemm, dims, d_x.get(), nullptr, w, d_bias.get(), s, nullptr);
  const auto probs = download_f32(s.probs, N * E), gates = download_f32(s.gates, N);
  const auto idx = download_raw(s.idx, N);
  const auto counts = download_raw(s.counts, E);
  for (std::int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(idx[n], cs.idx[n]) << "token " << n;
    EXPECT_EQ(idx[n], n % experts) << "token " << n;
    EXPECT_EQ(gates[n], probs[n * E + idx[n]]) << "token " << n;
  }
  for (std::int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(counts[e], cs.counts[e]) << "class " << e;
    EXPECT_EQ(counts[e], e < experts ? N / experts : 0) << "class " << e;
  }
  EXPECT_LT(logged_rel_err("gates", gates, std::vector<float>(cs.gates.data(), cs.gates.data() + N)), 2e-2) << "gates";
}

// Both twins write the skip rows (y = 0, dx = 0, dgates = 0: a skip token's MoE output is 0) and
// leave every other row untouched. Both start from the same non-zero values: the skip rows must match the CPU op and
// the other rows must still hold their starting values exactly.
TEST(ZayaRouterCuda, SkipPathWritesTheSkipRowsLikeCpu) {
  KEEL_REQUIRE_GPU();
  namespace zr = ops::zaya_router;
  namespace kzr = ops::cuda::zaya_router;
  const std::int64_t N = 53, H = 200;
  const int skip = 16;
  std::vector<std::int32_t> idx(N);
  for (std::int64_t n = 0; n < N; ++n) idx[n] = n % 3 == 0 ? skip : static_cast<std::int32_t>(n % 16);
  auto x = rounded_bf16(random_vector(N * H, 80)), gates = random_vector(N, 81, 0.05f, 1.f);
  auto dy = random_vector(N * H, 82), y0 = random_vector(N * H, 83), dx0 = rounded_bf16(random_vector(N * H, 84)),
       dg0 = random_vector(N, 85);
  std::vector<float> y = y0, dx = dx0, dg = dg0;
  zr::skip_forward(Tensor(x.data(), {N, H}), idx.data(), Tensor(gates.data(), {N, 1}), skip, Tensor(y.data(), {N, H}));
  zr::skip_backward(Tensor(x.data(), {N, H}), idx.data(), Tensor(gates.data(), {N, 1}), skip, Tensor(dy.data(), {N, H}),
                    Tensor(dx.data(), {N, H}), Tensor(dg.data(), {N, 1}));
  auto d_x = to_device<cuda_bf16>(x);
  auto d_idx = upload_raw(idx);
  auto d_g = to_device<float>(gates), d_dy = to_device<float>(dy), d_y = to_device<float>(y0),
       d_dg = to_device<float>(dg0);
  auto d_dx = to_device<cuda_bf16>(dx0);
  kzr::skip_forward(d_x.get(), d_idx.get(), d_g.get(), skip, d_y.get(), N, H, nullptr);
  kzr::skip_backward(d_x.get(), d_idx.get(), d_g.get(), skip, d_dy.get(), d_dx.get(), d_dg.get(), N, H, nullptr);
  const auto got_y = to_host(d_y), got_dx = to_host(d_dx), got_dg = to_host(d_dg);
  // Split each output into its skip rows (compared with the CPU op) and the other rows (which
  // must be their starting values, bit for bit).
  auto rows = [&](const std::vector<float>& v, std::int64_t w, bool skipped) {
    std::vector<float> r;
    for (std::int64_t n = 0; n < N; ++n)
      if ((idx[n] == skip) == skipped) r.insert(r.end(), v.begin() + n * w, v.begin() + (n + 1) * w);
    return r;
  };
  EXPECT_TRUE(all_close(rows(got_y, H, true), rows(y, H, true), 1e-6f, 1e-6f, "y = 0 on skip rows"));
  EXPECT_TRUE(all_close(rows(got_dx, H, true), rows(dx, H, true), 4e-3f, 1e-6f, "dx = 0 (bf16) on skip rows"));
  EXPECT_TRUE(all_close(rows(got_dg, 1, true), rows(dg, 1, true), 1e-5f, 1e-4f, "dgates = 0 on skip rows"));
  EXPECT_TRUE(all_close(rows(got_y, H, false), rows(y0, H, false), 0.f, 0.f, "y untouched on other rows"));
  EXPECT_TRUE(all_close(rows(got_dx, H, false), rows(dx0, H, false), 0.f, 0.f, "dx untouched on other rows"));
  EXPECT_TRUE(all_close(rows(got_dg, 1, false), rows(dg0, 1, false), 0.f, 0.f, "dgates untouched on other rows"));
  for (std::int64_t n = 0; n < N; ++n)
    if (idx[n] == skip) ASSERT_EQ(y[n * H], 0.f) << "the CPU op's skip row " << n;
  // The CPU op left the same rows untouched.
  EXPECT_TRUE(all_close(rows(y, H, false), rows(y0, H, false), 0.f, 0.f, "CPU y untouched on other rows"));
  EXPECT_TRUE(all_close(rows(dx, H, false), rows(dx0, H, false), 0.f, 0.f, "CPU dx untouched on other rows"));
  EXPECT_TRUE(all_close(rows(dg, 1, false), rows(dg0, 1, false), 0.f, 0.f, "CPU dgates untouched on other rows"));
}

// ---------------------------------------------------------------- CCA

struct CcaShape {
  std::int64_t B, T, H, nq, nkv, d;
  int W0, W1;
  float l2_eps;
  std::int64_t shift_begin = -1, shift_end = -1;  // Config::v_shift_*: -1, the second half
};

TEST(CcaCuda, ForwardAndBackwardMatchCpu) {
  KEEL_REQUIRE_GPU();
  namespace ca = ops::cca;
  namespace kca = ops::cuda::cca;
  auto& gemm = ops::cuda::thread_gemm();
  // ZAYA1-tiny (hidden 256, 4 q heads x 64, 2 kv heads: q dim 256, k dim 128, values 64 + 64,
  // conv widths 2); GQA 8/2 with a 3-wide depthwise conv; head dim 128 with one kv head (both
  // value halves in one head), a 3-wide grouped conv and l2_eps. Then the value-shift ranges of
  // tensor-parallel ranks (blocks::cca_config): all columns shifted (the rank holding the
  // previous-token head), none, and a range inside a head.
  for (const CcaShape cs : {CcaShape{2, 37, 256, 4, 2, 64, 2, 2, 0.f}, CcaShape{2, 70, 192, 8, 2, 64, 3, 2, 0.f},
                            CcaShape{1, 45, 128, 2, 1, 128, 2, 3, 1e-3f},
                            CcaShape{2, 37, 256, 4, 2, 64, 2, 2, 0.f, 0, 128},
                            CcaShape{2, 37, 256, 4, 2, 64, 2, 2, 0.f, 128, 128},
                            CcaShape{1, 45, 128, 2, 1, 128, 2, 3, 1e-3f, 32, 96}}) {
    SCOPED_TRACE(testing::Message() << "B " << cs.B << " T " << cs.T << " H " << cs.H << " nq " << cs.nq << " nkv "
                                    << cs.nkv << " d " << cs.d << " W " << cs.W0 << "," << cs.W1 << " shift ["
                                    << cs.shift_begin << ", " << cs.shift_end << ")");
    ca::Config c;
    c.hidden = cs.H, c.q_heads = cs.nq, c.kv_heads = cs.nkv, c.head_dim = cs.d;
    c.conv0_width = cs.W0, c.conv1_width = cs.W1, c.l2_eps = cs.l2_eps;
    c.v_shift_begin = cs.shift_begin, c.v_shift_end = cs.shift_end;
    const std::int64_t B = cs.B, T = cs.T, N = B * T, H = cs.H, d = cs.d, C = c.qk_channels(), nq = cs.nq,
                       nkv = cs.nkv;
    const std::int64_t W0 = cs.W0, W1 = cs.W1;
    const ops::rope::Table rt = ops::rope::make_table(int(d), 0.5, 10000.0, 128);
    const float sh = 1.f / std::sqrt(float(H));
    // order: w_qk w_v conv0_w conv0_b conv1_w conv1_b temp w_o (GEMM weights rounded to bf16)
    std::vector<std::vector<float>> p = {rounded_bf16(random_vector(C * H, 700, -sh, sh)),
                                         rounded_bf16(random_vector(nkv * d * H, 701, -sh, sh)),
                                         random_vector(C * W0, 702, -0.8f, 0.8f),
                                         random_vector(C, 703, -0.3f, 0.3f),
                                         random_vector(C * d * W1, 704, -0.5f / std::sqrt(float(d)), 0.5f / std::sqrt(float(d))),
                                         random_vector(C, 705, -0.3f, 0.3f),
                                         random_vector(nkv, 706, 0.5f, 1.5f),
                                         rounded_bf16(random_vector(H * nq * d, 707, -1.f / std::sqrt(float(nq * d)),
                                                                    1.f / std::sqrt(float(nq * d))))};
    auto view = [&](std::vector<std::vector<float>>& v) {
      ca::Params q;
      q.w_qk = Tensor(v[0].data(), {C, H});
      q.w_v = Tensor(v[1].data(), {nkv * d, H});
      q.conv0_w = Tensor(v[2].data(), {C, W0});
      q.conv0_b = Tensor(v[3].data(), {C});
      q.conv1_w = Tensor(v[4].data(), {C, d, W1});
      q.conv1_b = Tensor(v[5].data(), {C});
      q.temp = Tensor(v[6].data(), {nkv});
      q.w_o = Tensor(v[7].data(), {H, nq * d});
      return q;
    };
    auto x = rounded_bf16(random_vector(N * H, 710));
    std::vector<std::int32_t> pos(N);
    for (std::int64_t i = 0; i < N; ++i) pos[i] = static_cast<std::int32_t>(i % T);
    std::vector<float> y(N * H), saved_buf(ca::saved_floats(c, B, T));
    const ca::Saved sv = ca::carve_saved(c, B, T, saved_buf.data());
    ca::forward(c, B, T, Tensor(x.data(), {N, H}), pos.data(), rt, view(p), sv, Tensor(y.data(), {N, H}));

    // GPU forward.
    auto d_x = to_device<cuda_bf16>(x);
    auto d_pos = upload_raw(pos);
    ops::cuda::rope::UploadedTable d_rt(rt);
    auto d_wqk = to_device<cuda_bf16>(p[0]), d_wv = to_device<cuda_bf16>(p[1]), d_wo = to_device<cuda_bf16>(p[7]);
    auto d_c0w = to_device<float>(p[2]), d_c0b = to_device<float>(p[3]), d_c1w = to_device<float>(p[4]),
         d_c1b = to_device<float>(p[5]), d_temp = to_device<float>(p[6]);
    kca::Weights w;
    w.w_qk = d_wqk.get(), w.w_v = d_wv.get(), w.w_o = d_wo.get();
    w.conv0_w = d_c0w.get(), w.conv0_b = d_c0b.get(), w.conv1_w = d_c1w.get(), w.conv1_b = d_c1b.get();
    w.temp = d_temp.get();
    DeviceArray<unsigned char> d_saved(kca::saved_bytes(c, B, T));
    const kca::Saved s = kca::carve_saved(c, B, T, d_saved.get());
    DeviceArray<cuda_bf16> d_y(N * H);
    kca::forward(gemm, c, B, T, d_x.get(), d_pos.get(), d_rt.view(), w, s, d_y.get(), nullptr);

    auto cpu = [](const Tensor& t) { return std::vector<float>(t.data(), t.data() + t.numel()); };
    EXPECT_LT(norm_rel_err(download_f32(s.qk, N * C), cpu(sv.qk)), 1e-2) << "qk (pre-norm)";
    EXPECT_LT(norm_rel_err(download_bf16(s.q, N * nq * d), cpu(sv.q)), 1e-2) << "q";
    EXPECT_LT(norm_rel_err(download_bf16(s.k, N * nkv * d), cpu(sv.k)), 1e-2) << "k";
    EXPECT_LT(norm_rel_err(download_bf16(s.v, N * nkv * d), cpu(sv.v)), 1e-2) << "v";
    EXPECT_LT(norm_rel_err(download_bf16(s.att, N * nq * d), cpu(sv.att)), 2e-2) << "att";
    EXPECT_LT(logged_rel_err("y", to_host(d_y), y), 2e-2) << "y";

    // Backward: gradients accumulate onto non-zero buffers.
    auto dy = rounded_bf16(random_vector(N * H, 720));
    std::vector<std::vector<float>> g0;
    for (std::size_t i = 0; i < p.size(); ++i) g0.push_back(random_vector(p[i].size(), 730 + i, -0.1f, 0.1f));
    auto g = g0;
    std::vector<float> dx(N * H), scratch(ca::backward_scratch_floats(c, B, T));
    ca::backward(c, B, T, Tensor(x.data(), {N, H}), pos.data(), rt, view(p), sv, Tensor(dy.data(), {N, H}),
                 Tensor(dx.data(), {N, H}), view(g), Tensor(scratch.data(), {std::int64_t(scratch.size())}));
    // Scale of dtemp: |sum_n sqrt(d) rn (a . g_n)| <= sqrt(d) sum_n |g_n| with g the CPU's
    // post-RoPE-inverse dk (its scratch layout: datt [N, nq d], dq [N, nq d], then dk).
    std::vector<double> temp_scale(nkv, 0.0);
    {
      const float* dk = scratch.data() + 2 * N * nq * d;
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t gk = 0; gk < nkv; ++gk) {
          double ss = 0;
          for (std::int64_t i = 0; i < d; ++i) ss += double(dk[(n * nkv + gk) * d + i]) * dk[(n * nkv + gk) * d + i];
          temp_scale[gk] += std::sqrt(double(d)) * std::sqrt(ss);
        }
    }

    std::vector<DeviceArray<float>> d_g;
    for (auto& v : g0) d_g.push_back(to_device<float>(v));
    kca::Grads gr;
    gr.w_qk = d_g[0].get(), gr.w_v = d_g[1].get(), gr.conv0_w = d_g[2].get(), gr.conv0_b = d_g[3].get();
    gr.conv1_w = d_g[4].get(), gr.conv1_b = d_g[5].get(), gr.temp = d_g[6].get(), gr.w_o = d_g[7].get();
    auto d_dy = to_device<cuda_bf16>(dy);
    DeviceArray<cuda_bf16> d_dx(N * H);
    DeviceArray<unsigned char> d_scratch(kca::backward_scratch_bytes(c, B, T));
    kca::backward(gemm, c, B, T, d_x.get(), d_pos.get(), d_rt.view(), w, s, d_dy.get(), d_dx.get(), gr,
                  d_scratch.get(), nullptr);
    EXPECT_LT(logged_rel_err("dx", to_host(d_dx), dx), 3e-2) << "dx";
    const char* names[] = {"w_qk", "w_v", "conv0_w", "conv0_b", "conv1_w", "conv1_b", "temp", "w_o"};
    for (std::size_t i = 0; i < p.size(); ++i) {
      const auto got = minus(to_host(d_g[i]), g0[i]), want = minus(g[i], g0[i]);
      if (i == 6) {
        for (std::int64_t gk = 0; gk < nkv; ++gk) {
          std::printf("    dtemp[%d] got %.5g want %.5g (scale %.3g)\n", int(gk), got[gk], want[gk], temp_scale[gk]);
          EXPECT_LE(std::fabs(double(got[gk]) - want[gk]), 1e-2 * temp_scale[gk])
              << "dtemp[" << gk << "] got " << got[gk] << " want " << want[gk] << " scale " << temp_scale[gk];
        }
        continue;
      }
      EXPECT_LT(logged_rel_err(names[i], got, want), 3e-2) << names[i];
    }
  }
}

TEST(CcaCuda, RejectsUnsupportedHeadDim) {
  KEEL_REQUIRE_GPU();
  ops::cca::Config c;
  c.hidden = 64, c.q_heads = 2, c.kv_heads = 1, c.head_dim = 32;
  EXPECT_THROW(ops::cuda::cca::backward_scratch_bytes(c, 1, 8), Error);
}

}  // namespace
}  // namespace keel

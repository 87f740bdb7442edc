// The CUDA flash attention against the fp32 CPU reference (ops/attention.h) on bf16-rounded
// random inputs, full causal and with sliding windows, plus a timing of the training shape
// (printed, not asserted).
#include "ops/cuda/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/attention.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

namespace gpu = ops::cuda::attention;
using test::all_close;
using test::DeviceArray;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
using test::to_host;
using Bf16 = ops::cuda::bf16;

struct Shape {
  int B, T, Hq, Hkv, Dh;
};

std::string name(const Shape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " Hq=" + std::to_string(s.Hq) +
         " Hkv=" + std::to_string(s.Hkv) + " Dh=" + std::to_string(s.Dh);
}

double rms(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return x.empty() ? 0.0 : std::sqrt(s / x.size());
}

// ||got - want|| / max(||want||, 1e-3 sqrt(n)): the error of the whole gradient, insensitive
// to where bf16 rounding happens to hit hardest. The floor matters where the exact gradient is
// zero: with T = 1 the softmax has one entry, so dq = dk = 0 exactly and both sides only hold
// fp32 rounding noise (~1e-7) of D_i - dout_i . v_i.
double norm_rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-6 * static_cast<double>(want.size())));
}

// Inputs scaled to roughly unit variance (uniform in +-1.7), rounded to bf16 so the CPU
// reference sees exactly what the GPU sees.
struct Inputs {
  std::vector<float> q, k, v, dout;
};

Inputs make_inputs(const Shape& s, std::uint64_t seed) {
  const std::size_t nq = static_cast<std::size_t>(s.B) * s.T * s.Hq * s.Dh;
  const std::size_t nkv = static_cast<std::size_t>(s.B) * s.T * s.Hkv * s.Dh;
  return {rounded_bf16(random_vector(nq, seed, -1.7f, 1.7f)), rounded_bf16(random_vector(nkv, seed + 1, -1.7f, 1.7f)),
          rounded_bf16(random_vector(nkv, seed + 2, -1.7f, 1.7f)), rounded_bf16(random_vector(nq, seed + 3, -1.f, 1.f))};
}

// window: 0 = full causal, W > 0 = sliding (the CPU reference is tested against a naive masked
// softmax in tests/ops/rope_attention_test.cc).
void check_shape(const Shape& s, std::uint64_t seed, int window = 0) {
  SCOPED_TRACE(name(s) + " window=" + std::to_string(window));
  const float scale = 1.f / std::sqrt(static_cast<float>(s.Dh));
  Inputs in = make_inputs(s, seed);
  const std::size_t nq = in.q.size(), nkv = in.k.size(), nl = static_cast<std::size_t>(s.B) * s.Hq * s.T;

  // CPU reference forward.
  std::vector<float> out_ref(nq), lse_ref(nl);
  const Tensor tq(in.q.data(), {s.B, s.T, s.Hq, s.Dh}), tk(in.k.data(), {s.B, s.T, s.Hkv, s.Dh});
  const Tensor tv(in.v.data(), {s.B, s.T, s.Hkv, s.Dh});
  ops::attention::forward(tq, tk, tv, scale, Tensor(out_ref.data(), {s.B, s.T, s.Hq, s.Dh}),
                          Tensor(lse_ref.data(), {s.B, s.Hq, s.T}), window);

  // GPU forward; out and lse poisoned so unwritten elements show.
  auto q = to_device<Bf16>(in.q), k = to_device<Bf16>(in.k), v = to_device<Bf16>(in.v);
  auto out = to_device<Bf16>(std::vector<float>(nq, 1e4f));
  auto lse = to_device<float>(std::vector<float>(nl, 1e4f));
  gpu::forward(q.get(), k.get(), v.get(), out.get(), lse.get(), s.B, s.T, s.Hq, s.Hkv, s.Dh, scale, window, nullptr);
  KEEL_CUDA_CHECK(cudaGetLastError());
  EXPECT_TRUE(all_close(to_host(out), out_ref, 2e-2f, 2e-2f, "out"));
  EXPECT_TRUE(all_close(to_host(lse), lse_ref, 1e-3f, 1e-3f, "lse"));

  // Backward in isolation: both sides get the same bf16 out and the reference lse.
  const std::vector<float> out_in = rounded_bf16(out_ref);
  std::vector<float> dq_ref(nq), dk_ref(nkv), dv_ref(nkv);
  std::vector<float> out_in_copy = out_in, lse_copy = lse_ref;
  ops::attention::backward(tq, tk, tv, Tensor(out_in_copy.data(), {s.B, s.T, s.Hq, s.Dh}),
                           Tensor(lse_copy.data(), {s.B, s.Hq, s.T}), Tensor(in.dout.data(), {s.B, s.T, s.Hq, s.Dh}),
                           scale, Tensor(dq_ref.data(), {s.B, s.T, s.Hq, s.Dh}),
                           Tensor(dk_ref.data(), {s.B, s.T, s.Hkv, s.Dh}), Tensor(dv_ref.data(), {s.B, s.T, s.Hkv, s.Dh}),
                           window);

  auto out_d = to_device<Bf16>(out_in), dout = to_device<Bf16>(in.dout);
  auto lse_d = to_device<float>(lse_ref);
  auto dq = to_device<Bf16>(std::vector<float>(nq, 1e4f));
  auto dk = to_device<Bf16>(std::vector<float>(nkv, 1e4f)), dv = to_device<Bf16>(std::vector<float>(nkv, 1e4f));
  const std::size_t ws_bytes = gpu::backward_workspace_bytes(s.B, s.T, s.Hq, s.Hkv, s.Dh);
  DeviceArray<unsigned char> ws(ws_bytes);
  KEEL_CUDA_CHECK(cudaMemset(ws.get(), 0x7f, ws_bytes));  // garbage: backward must not rely on zeros
  gpu::backward(q.get(), k.get(), v.get(), out_d.get(), lse_d.get(), dout.get(), dq.get(), dk.get(), dv.get(), ws.get(),
                s.B, s.T, s.Hq, s.Hkv, s.Dh, scale, window, nullptr);
  KEEL_CUDA_CHECK(cudaGetLastError());

  const struct {
    const char* what;
    std::vector<float> got;
    const std::vector<float>& want;
  } grads[] = {{"dq", to_host(dq), dq_ref}, {"dk", to_host(dk), dk_ref}, {"dv", to_host(dv), dv_ref}};
  for (const auto& g : grads) {
    const double rel = norm_rel_error(g.got, g.want);
    EXPECT_LT(rel, 2e-2) << g.what << " norm-relative error";
    EXPECT_TRUE(all_close(g.got, g.want, 5e-2f, static_cast<float>(0.05 * rms(g.want) + 1e-4), g.what));
  }
}

TEST(AttentionCuda, TinySequences) {
  KEEL_REQUIRE_GPU();
  for (int T = 1; T <= 3; ++T) {
    check_shape({2, T, 4, 4, 64}, 100 + T);
    check_shape({2, T, 8, 2, 128}, 200 + T);
  }
}

TEST(AttentionCuda, OddLengthsMha) {
  KEEL_REQUIRE_GPU();
  check_shape({2, 77, 4, 4, 64}, 301);
  check_shape({2, 200, 4, 4, 128}, 302);
}

TEST(AttentionCuda, OddLengthsGqa) {
  KEEL_REQUIRE_GPU();
  check_shape({2, 77, 8, 2, 128}, 401);
  check_shape({2, 200, 16, 2, 64}, 402);
  check_shape({1, 130, 16, 2, 128}, 403);
}

TEST(AttentionCuda, WholeTiles) {
  KEEL_REQUIRE_GPU();
  check_shape({2, 256, 4, 4, 128}, 501);
  check_shape({2, 256, 8, 2, 64}, 502);
  check_shape({2, 256, 16, 2, 128}, 503);
}

// Sliding windows around the kernels' tiles (forward: 128 queries x 64 keys; backward: 128 keys
// x 64 queries): one key, windows inside a tile, at and across tile edges, several tiles, T or
// more (full causal), on odd and whole lengths, MHA and GQA, Dh 64 and 128.
TEST(AttentionCuda, SlidingWindow) {
  KEEL_REQUIRE_GPU();
  for (int w : {1, 5, 63, 64, 65, 128, 129, 200, 300}) {
    check_shape({2, 200, 4, 4, 64}, 600 + w, w);
    check_shape({1, 333, 8, 2, 128}, 700 + w, w);
  }
  check_shape({2, 77, 16, 2, 64}, 801, 13);
  check_shape({2, 3, 4, 4, 128}, 802, 2);
}

TEST(AttentionCuda, RejectsBadExtents) {
  KEEL_REQUIRE_GPU();
  DeviceArray<Bf16> x(4096);
  DeviceArray<float> l(64);
  EXPECT_THROW(gpu::forward(x.get(), x.get(), x.get(), x.get(), l.get(), 1, 4, 2, 2, 96, 0.1f, 0, nullptr), Error);
  EXPECT_THROW(gpu::forward(x.get(), x.get(), x.get(), x.get(), l.get(), 1, 4, 6, 4, 64, 0.1f, 0, nullptr), Error);
  EXPECT_THROW(gpu::forward(x.get(), x.get(), x.get(), x.get(), l.get(), 1, 4, 2, 2, 64, 0.1f, -1, nullptr), Error);
  EXPECT_THROW(gpu::backward_workspace_bytes(1, 4, 6, 4, 64), Error);
  EXPECT_THROW(gpu::backward_workspace_bytes(1, 4, 4, 4, 32), Error);
}

// Host reference of one query row (b, h, t) of the forward (keys j0..t: j0 = 0, or the window's
// first), for spot checks at sizes where the whole CPU reference would take too long.
void reference_row(const Inputs& in, const Shape& s, float scale, int window, int b, int h, int t,
                   std::vector<float>& o, float& lse) {
  const int g = h / (s.Hq / s.Hkv);
  auto qrow = [&](int tt) { return in.q.data() + ((static_cast<std::size_t>(b) * s.T + tt) * s.Hq + h) * s.Dh; };
  auto kvrow = [&](const std::vector<float>& x, int tt) {
    return x.data() + ((static_cast<std::size_t>(b) * s.T + tt) * s.Hkv + g) * s.Dh;
  };
  const int j0 = static_cast<int>(ops::attention::first_key(t, window));
  std::vector<double> p(t + 1);
  double m = -1e300;
  for (int j = j0; j <= t; ++j) {
    double d = 0;
    for (int c = 0; c < s.Dh; ++c) d += static_cast<double>(qrow(t)[c]) * kvrow(in.k, j)[c];
    p[j] = scale * d;
    m = std::max(m, p[j]);
  }
  double sum = 0;
  for (int j = j0; j <= t; ++j) sum += (p[j] = std::exp(p[j] - m));
  o.assign(s.Dh, 0.f);
  for (int c = 0; c < s.Dh; ++c) {
    double acc = 0;
    for (int j = j0; j <= t; ++j) acc += p[j] * kvrow(in.v, j)[c];
    o[c] = static_cast<float>(acc / sum);
  }
  lse = static_cast<float>(m + std::log(sum));
}

// Times forward and backward at the training shape (printed, not asserted) with the FLOPs the
// mask leaves (causal: half the square; a window W: W - W^2 / 2T keys per query), then spot
// checks rows against the host reference and the gradients for finiteness.
void time_and_spot_check(int window) {
  const Shape s{2, 4096, 16, 2, 128};
  const float scale = 1.f / std::sqrt(static_cast<float>(s.Dh));
  const Inputs in = make_inputs(s, 7);
  const std::size_t nq = in.q.size(), nkv = in.k.size(), nl = static_cast<std::size_t>(s.B) * s.Hq * s.T;
  auto q = to_device<Bf16>(in.q), k = to_device<Bf16>(in.k), v = to_device<Bf16>(in.v), dout = to_device<Bf16>(in.dout);
  DeviceArray<Bf16> out(nq), dq(nq), dk(nkv), dv(nkv);
  DeviceArray<float> lse(nl);
  DeviceArray<unsigned char> ws(gpu::backward_workspace_bytes(s.B, s.T, s.Hq, s.Hkv, s.Dh));

  cudaEvent_t start, stop;
  KEEL_CUDA_CHECK(cudaEventCreate(&start));
  KEEL_CUDA_CHECK(cudaEventCreate(&stop));
  auto time_ms = [&](auto&& fn) {
    for (int i = 0; i < 3; ++i) fn();
    KEEL_CUDA_CHECK(cudaEventRecord(start, nullptr));
    constexpr int kRuns = 10;
    for (int i = 0; i < kRuns; ++i) fn();
    KEEL_CUDA_CHECK(cudaEventRecord(stop, nullptr));
    KEEL_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.f;
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms / kRuns;
  };
  const float fwd_ms = time_ms([&] {
    gpu::forward(q.get(), k.get(), v.get(), out.get(), lse.get(), s.B, s.T, s.Hq, s.Hkv, s.Dh, scale, window, nullptr);
  });
  const float bwd_ms = time_ms([&] {
    gpu::backward(q.get(), k.get(), v.get(), out.get(), lse.get(), dout.get(), dq.get(), dk.get(), dv.get(), ws.get(), s.B,
                  s.T, s.Hq, s.Hkv, s.Dh, scale, window, nullptr);
  });
  KEEL_CUDA_CHECK(cudaEventDestroy(start));
  KEEL_CUDA_CHECK(cudaEventDestroy(stop));

  // Two T x keys x Dh matmuls per head, keys per query as the mask leaves them; backward 2.5x.
  const double T = s.T, W = window > 0 && window < s.T ? window : T, keys = W - W * W / (2 * T);
  const double fwd_flops = 2.0 * 2.0 * T * keys * s.Dh * s.Hq * s.B;
  const double bwd_flops = 2.5 * fwd_flops;
  std::printf("[attention cuda] B=%d T=%d Hq=%d Hkv=%d Dh=%d window=%d: forward %.3f ms (%.1f TFLOP/s), backward "
              "%.3f ms (%.1f TFLOP/s)\n",
              s.B, s.T, s.Hq, s.Hkv, s.Dh, window, fwd_ms, fwd_flops / (fwd_ms * 1e-3) / 1e12, bwd_ms,
              bwd_flops / (bwd_ms * 1e-3) / 1e12);

  // Spot checks at full length: a few forward rows against a host reference, and the
  // gradients finite everywhere.
  const std::vector<float> out_h = to_host(out), lse_h = to_host(lse);
  for (const int b : {0, 1}) {
    for (const int h : {0, 7, 15}) {
      for (const int t : {0, 1, 63, 64, 1023, 1024, 1090, 2047, 4095}) {
        std::vector<float> o;
        float l = 0.f;
        reference_row(in, s, scale, window, b, h, t, o, l);
        const std::size_t row = (static_cast<std::size_t>(b) * s.T + t) * s.Hq + h;
        const std::vector<float> got(out_h.begin() + row * s.Dh, out_h.begin() + (row + 1) * s.Dh);
        EXPECT_TRUE(all_close(got, o, 2e-2f, 2e-2f, "out row")) << "b=" << b << " h=" << h << " t=" << t;
        EXPECT_NEAR(lse_h[(static_cast<std::size_t>(b) * s.Hq + h) * s.T + t], l, 1e-3f * (1.f + std::fabs(l)));
      }
    }
  }
  for (const auto* g : {&dq, &dk, &dv}) {
    const std::vector<float> x = to_host(*g);
    const std::size_t bad = std::count_if(x.begin(), x.end(), [](float f) { return !std::isfinite(f); });
    EXPECT_EQ(bad, 0u) << "non-finite gradient elements";
  }
}

// ---- Ring attention's pieces (forward_block, merge_block, dot_rows, backward_block) against
// the CPU's forward_block / merge / backward_block: a run of 96 queries (the second half of 192
// rows per sequence, so the strides matter) against a block of 80 keys on the causal diagonal,
// partly and wholly in the past, and with a window; merging two halves of a past block gives
// the whole block; a block wholly before the run's windows gives out 0 and lse -inf. ----

struct BlockCase {
  int p0, window;
};

TEST(AttentionCuda, RingBlockPiecesMatchCpu) {
  KEEL_REQUIRE_GPU();
  const int B = 2, Hq = 4, Hkv = 2, Dh = 64, q_rows = 192, Lq = 96, r0 = 96, Tk = 80;
  const float scale = 1.f / std::sqrt(static_cast<float>(Dh));
  const std::size_t nq = std::size_t(B) * q_rows * Hq * Dh, nkv = std::size_t(B) * Tk * Hkv * Dh;
  const std::vector<float> q = rounded_bf16(random_vector(nq, 71, -1.7f, 1.7f));
  const std::vector<float> k = rounded_bf16(random_vector(nkv, 72, -1.7f, 1.7f));
  const std::vector<float> v = rounded_bf16(random_vector(nkv, 73, -1.7f, 1.7f));
  const std::vector<float> dout = rounded_bf16(random_vector(nq, 74, -1.f, 1.f));
  // the run's rows alone, [B, Lq, Hq, Dh], for the CPU
  const auto run_rows = [&](const std::vector<float>& full) {
    std::vector<float> r(std::size_t(B) * Lq * Hq * Dh);
    for (int b = 0; b < B; ++b)
      std::copy_n(full.begin() + (std::size_t(b) * q_rows + r0) * Hq * Dh, std::size_t(Lq) * Hq * Dh,
                  r.begin() + std::size_t(b) * Lq * Hq * Dh);
    return r;
  };
  const auto run_lse = [&](const std::vector<float>& full) {  // [B, Hq, q_rows] -> [B, Hq, Lq]
    std::vector<float> r(std::size_t(B) * Hq * Lq);
    for (int bh = 0; bh < B * Hq; ++bh)
      std::copy_n(full.begin() + std::size_t(bh) * q_rows + r0, Lq, r.begin() + std::size_t(bh) * Lq);
    return r;
  };
  std::vector<float> q_run = run_rows(q), dout_run = run_rows(dout);
  auto d_q = to_device<Bf16>(q), d_k = to_device<Bf16>(k), d_v = to_device<Bf16>(v), d_dout = to_device<Bf16>(dout);
  const std::size_t off = std::size_t(r0) * Hq * Dh;
  std::vector<std::int32_t> k_pos(Tk);
  for (int j = 0; j < Tk; ++j) k_pos[j] = j;
  const Tensor tq(q_run.data(), {B, Lq, Hq, Dh}), tk(const_cast<float*>(k.data()), {B, Tk, Hkv, Dh});
  const Tensor tv(const_cast<float*>(v.data()), {B, Tk, Hkv, Dh}), tdo(dout_run.data(), {B, Lq, Hq, Dh});
  for (const BlockCase c : {BlockCase{0, 0}, BlockCase{50, 0}, BlockCase{200, 0}, BlockCase{30, 60}}) {
    SCOPED_TRACE("p0=" + std::to_string(c.p0) + " window=" + std::to_string(c.window));
    std::vector<std::int32_t> q_pos(Lq);
    for (int i = 0; i < Lq; ++i) q_pos[i] = c.p0 + i;
    std::vector<float> out_ref(q_run.size()), lse_ref(std::size_t(B) * Hq * Lq);
    ops::attention::forward_block(tq, tk, tv, q_pos.data(), k_pos.data(), scale, Tensor(out_ref.data(), {B, Lq, Hq, Dh}),
                                  Tensor(lse_ref.data(), {B, Hq, Lq}), c.window);
    DeviceArray<float> out(nq);  // fp32: the merge's input
    DeviceArray<float> lse(std::size_t(B) * Hq * q_rows);
    gpu::forward_block(d_q.get() + off, d_k.get(), d_v.get(), out.get() + off, lse.get() + r0, B, q_rows, Lq, c.p0, Tk,
                       Hq, Hkv, Dh, scale, c.window, nullptr);
    const std::vector<float> out_got = run_rows(to_host(out)), lse_got = run_lse(to_host(lse));
    // bf16 operands (p and v in the MMAs), fp32 out: tighter than the bf16 outputs' 2e-2
    EXPECT_TRUE(all_close(out_got, out_ref, 1e-2f, 1e-2f, "block out"));
    for (std::size_t i = 0; i < lse_ref.size(); ++i)
      ASSERT_NEAR(lse_got[i], lse_ref[i], 1e-3f * (1.f + std::fabs(lse_ref[i]))) << "lse " << i;

    // backward with the block's own (out, lse) as the final ones
    std::vector<float> dq_ref(q_run.size(), 0.f), dk_ref(nkv), dv_ref(nkv);
    ops::attention::backward_block(tq, tk, tv, q_pos.data(), k_pos.data(), Tensor(out_ref.data(), {B, Lq, Hq, Dh}),
                                   Tensor(lse_ref.data(), {B, Hq, Lq}), tdo, scale, Tensor(dq_ref.data(), {B, Lq, Hq, Dh}),
                                   Tensor(dk_ref.data(), {B, Tk, Hkv, Dh}), Tensor(dv_ref.data(), {B, Tk, Hkv, Dh}),
                                   c.window);
    DeviceArray<float> d_row(std::size_t(B) * Hq * q_rows), dq(nq), dk(nkv), dv(nkv);
    auto out_bf = to_device<Bf16>(to_host(out));  // the final out is bf16 in the ring
    gpu::dot_rows(d_dout.get(), out_bf.get(), d_row.get(), B, q_rows, Hq, Dh, nullptr);
    gpu::backward_block(d_q.get() + off, d_k.get(), d_v.get(), d_dout.get() + off, lse.get() + r0, d_row.get() + r0,
                        dq.get() + off, dk.get(), dv.get(), B, q_rows, Lq, c.p0, Tk, Hq, Hkv, Dh, scale, c.window,
                        nullptr);
    EXPECT_LT(norm_rel_error(run_rows(to_host(dq)), dq_ref), 2e-2) << "dq";
    EXPECT_LT(norm_rel_error(to_host(dk), dk_ref), 2e-2) << "dk";
    EXPECT_LT(norm_rel_error(to_host(dv), dv_ref), 2e-2) << "dv";
  }

  // Two halves of a block wholly in the past, merged, against the whole block in one call.
  {
    const int p0 = 200, half = Tk / 2;
    DeviceArray<float> whole(nq), part(nq);
    DeviceArray<float> whole_lse(std::size_t(B) * Hq * q_rows), part_lse(std::size_t(B) * Hq * q_rows);
    DeviceArray<float> acc(nq);
    auto acc_lse = to_device<float>(std::vector<float>(std::size_t(B) * Hq * q_rows, -INFINITY));
    gpu::forward_block(d_q.get() + off, d_k.get(), d_v.get(), whole.get() + off, whole_lse.get() + r0, B, q_rows, Lq,
                       p0, Tk, Hq, Hkv, Dh, scale, 0, nullptr);
    // the halves as their own [B, half, Hkv, Dh] tensors
    std::vector<float> k1, v1, k2, v2;
    for (int b = 0; b < B; ++b) {
      const auto at = [&](int j) { return std::size_t(b * Tk + j) * Hkv * Dh; };
      k1.insert(k1.end(), k.begin() + at(0), k.begin() + at(half));
      v1.insert(v1.end(), v.begin() + at(0), v.begin() + at(half));
      k2.insert(k2.end(), k.begin() + at(half), k.begin() + at(Tk));
      v2.insert(v2.end(), v.begin() + at(half), v.begin() + at(Tk));
    }
    auto dk1 = to_device<Bf16>(k1), dv1 = to_device<Bf16>(v1), dk2 = to_device<Bf16>(k2), dv2 = to_device<Bf16>(v2);
    gpu::forward_block(d_q.get() + off, dk1.get(), dv1.get(), part.get() + off, part_lse.get() + r0, B, q_rows, Lq, p0,
                       half, Hq, Hkv, Dh, scale, 0, nullptr);
    gpu::merge_block(part.get() + off, part_lse.get() + r0, acc.get() + off, acc_lse.get() + r0, B, q_rows, Lq, Hq, Dh,
                     nullptr);
    gpu::forward_block(d_q.get() + off, dk2.get(), dv2.get(), part.get() + off, part_lse.get() + r0, B, q_rows, Lq,
                       p0 - half, half, Hq, Hkv, Dh, scale, 0, nullptr);
    gpu::merge_block(part.get() + off, part_lse.get() + r0, acc.get() + off, acc_lse.get() + r0, B, q_rows, Lq, Hq, Dh,
                     nullptr);
    EXPECT_TRUE(all_close(run_rows(to_host(acc)), run_rows(to_host(whole)), 1e-2f, 1e-2f, "merged halves"));
    const std::vector<float> lw = run_lse(to_host(whole_lse)), lm = run_lse(to_host(acc_lse));
    for (std::size_t i = 0; i < lw.size(); ++i) ASSERT_NEAR(lm[i], lw[i], 1e-4f * (1.f + std::fabs(lw[i]))) << i;
  }

  // A block wholly before every row's window: out 0, lse -inf.
  {
    auto out = to_device<float>(std::vector<float>(nq, 5.f));
    auto lse = to_device<float>(std::vector<float>(std::size_t(B) * Hq * q_rows, 7.f));
    gpu::forward_block(d_q.get() + off, d_k.get(), d_v.get(), out.get() + off, lse.get() + r0, B, q_rows, Lq, 300, Tk,
                       Hq, Hkv, Dh, scale, 60, nullptr);
    for (float x : run_lse(to_host(lse))) ASSERT_EQ(x, -INFINITY);
    for (float x : run_rows(to_host(out))) ASSERT_EQ(x, 0.f);
  }
}

TEST(AttentionCudaPerf, Forward4096) {
  KEEL_REQUIRE_GPU();
  time_and_spot_check(0);
}

// A quarter of the sequence: about 7/16 of the causal FLOPs, so about that share of the time.
TEST(AttentionCudaPerf, SlidingWindow1024Of4096) {
  KEEL_REQUIRE_GPU();
  time_and_spot_check(1024);
}

// ---- Queries in runs over a longer key sequence (context parallelism): forward_runs and
// backward_runs against the CPU forward_at/backward_at at the runs' positions. ----

struct RunsShape {
  int B, Tk, Hq, Hkv, Dh;
  std::vector<int> run_start;  // the runs' first positions
  int L;                       // queries per run: Tq = runs * L
  int window = 0;
};

std::string name(const RunsShape& s) {
  std::string starts;
  for (int p : s.run_start) starts += (starts.empty() ? "" : ",") + std::to_string(p);
  return "B=" + std::to_string(s.B) + " Tk=" + std::to_string(s.Tk) + " Hq=" + std::to_string(s.Hq) +
         " Hkv=" + std::to_string(s.Hkv) + " Dh=" + std::to_string(s.Dh) + " L=" + std::to_string(s.L) + " runs={" +
         starts + "} window=" + std::to_string(s.window);
}

// As check_shape, with q, dout of [B, Tq, Hq, Dh] at the runs' positions and k, v of Tk keys. dk,
// dv come back in fp32 and are also exactly zero at the keys no query attends.
void check_runs(const RunsShape& s, std::uint64_t seed) {
  SCOPED_TRACE(name(s));
  const int runs = static_cast<int>(s.run_start.size()), Tq = runs * s.L;
  const float scale = 1.f / std::sqrt(static_cast<float>(s.Dh));
  const std::size_t nq = static_cast<std::size_t>(s.B) * Tq * s.Hq * s.Dh;
  const std::size_t nkv = static_cast<std::size_t>(s.B) * s.Tk * s.Hkv * s.Dh;
  const std::size_t nl = static_cast<std::size_t>(s.B) * s.Hq * Tq;
  Inputs in{rounded_bf16(random_vector(nq, seed, -1.7f, 1.7f)), rounded_bf16(random_vector(nkv, seed + 1, -1.7f, 1.7f)),
            rounded_bf16(random_vector(nkv, seed + 2, -1.7f, 1.7f)), rounded_bf16(random_vector(nq, seed + 3, -1.f, 1.f))};
  std::vector<std::int32_t> q_pos(Tq);
  for (int r = 0; r < runs; ++r)
    for (int i = 0; i < s.L; ++i) q_pos[r * s.L + i] = s.run_start[r] + i;

  // CPU reference forward.
  std::vector<float> out_ref(nq), lse_ref(nl);
  const Tensor tq(in.q.data(), {s.B, Tq, s.Hq, s.Dh}), tk(in.k.data(), {s.B, s.Tk, s.Hkv, s.Dh});
  const Tensor tv(in.v.data(), {s.B, s.Tk, s.Hkv, s.Dh});
  ops::attention::forward_at(tq, tk, tv, q_pos.data(), scale, Tensor(out_ref.data(), {s.B, Tq, s.Hq, s.Dh}),
                             Tensor(lse_ref.data(), {s.B, s.Hq, Tq}), s.window);

  // GPU forward; out and lse poisoned so unwritten elements show.
  auto q = to_device<Bf16>(in.q), k = to_device<Bf16>(in.k), v = to_device<Bf16>(in.v);
  auto out = to_device<Bf16>(std::vector<float>(nq, 1e4f));
  auto lse = to_device<float>(std::vector<float>(nl, 1e4f));
  gpu::forward_runs(q.get(), k.get(), v.get(), out.get(), lse.get(), s.B, Tq, s.Tk, s.Hq, s.Hkv, s.Dh, scale, s.window,
                    s.run_start.data(), runs, nullptr);
  KEEL_CUDA_CHECK(cudaGetLastError());
  EXPECT_TRUE(all_close(to_host(out), out_ref, 2e-2f, 2e-2f, "out"));
  EXPECT_TRUE(all_close(to_host(lse), lse_ref, 1e-3f, 1e-3f, "lse"));

  // Backward in isolation: both sides get the same bf16 out and the reference lse.
  const std::vector<float> out_in = rounded_bf16(out_ref);
  std::vector<float> dq_ref(nq), dk_ref(nkv), dv_ref(nkv);
  std::vector<float> out_in_copy = out_in, lse_copy = lse_ref;
  ops::attention::backward_at(tq, tk, tv, q_pos.data(), Tensor(out_in_copy.data(), {s.B, Tq, s.Hq, s.Dh}),
                              Tensor(lse_copy.data(), {s.B, s.Hq, Tq}), Tensor(in.dout.data(), {s.B, Tq, s.Hq, s.Dh}),
                              scale, Tensor(dq_ref.data(), {s.B, Tq, s.Hq, s.Dh}),
                              Tensor(dk_ref.data(), {s.B, s.Tk, s.Hkv, s.Dh}),
                              Tensor(dv_ref.data(), {s.B, s.Tk, s.Hkv, s.Dh}), s.window);

  auto out_d = to_device<Bf16>(out_in), dout = to_device<Bf16>(in.dout);
  auto lse_d = to_device<float>(lse_ref);
  auto dq = to_device<Bf16>(std::vector<float>(nq, 1e4f));
  auto dk = to_device<float>(std::vector<float>(nkv, 1e4f)), dv = to_device<float>(std::vector<float>(nkv, 1e4f));
  const std::size_t ws_bytes = gpu::backward_runs_workspace_bytes(s.B, Tq, s.Tk, s.Hq, s.Hkv, s.Dh);
  DeviceArray<unsigned char> ws(ws_bytes);
  KEEL_CUDA_CHECK(cudaMemset(ws.get(), 0x7f, ws_bytes));  // garbage: backward must not rely on zeros
  gpu::backward_runs(q.get(), k.get(), v.get(), out_d.get(), lse_d.get(), dout.get(), dq.get(), dk.get(), dv.get(),
                     ws.get(), s.B, Tq, s.Tk, s.Hq, s.Hkv, s.Dh, scale, s.window, s.run_start.data(), runs, nullptr);
  KEEL_CUDA_CHECK(cudaGetLastError());

  const struct {
    const char* what;
    std::vector<float> got;
    const std::vector<float>& want;
  } grads[] = {{"dq", to_host(dq), dq_ref}, {"dk", to_host(dk), dk_ref}, {"dv", to_host(dv), dv_ref}};
  for (const auto& g : grads) {
    const double rel = norm_rel_error(g.got, g.want);
    EXPECT_LT(rel, 2e-2) << g.what << " norm-relative error";
    EXPECT_TRUE(all_close(g.got, g.want, 5e-2f, static_cast<float>(0.05 * rms(g.want) + 1e-4), g.what));
  }

  // Keys no query attends (key j is attended by a query at t when j <= t and, with a window W,
  // t - j < W): dk, dv exactly 0 there, as forward_at's reference.
  std::vector<char> seen(s.Tk, 0);
  for (const std::int32_t t : q_pos)
    for (int j = static_cast<int>(ops::attention::first_key(t, s.window)); j <= t; ++j) seen[j] = 1;
  std::size_t unseen = 0, nonzero = 0;
  const std::size_t row = static_cast<std::size_t>(s.Hkv) * s.Dh;
  for (int b = 0; b < s.B; ++b)
    for (int j = 0; j < s.Tk; ++j) {
      if (seen[j]) continue;
      ++unseen;
      const std::size_t at = (static_cast<std::size_t>(b) * s.Tk + j) * row;
      for (std::size_t c = 0; c < row; ++c) {
        EXPECT_EQ(dk_ref[at + c], 0.f);
        nonzero += grads[1].got[at + c] != 0.f || grads[2].got[at + c] != 0.f;
      }
    }
  EXPECT_EQ(nonzero, 0u) << "dk, dv elements not zero at the " << unseen << " keys no query attends";
}

// Context parallelism over C = 2 ranks with zigzag runs: of 4 chunks of 128 of a 512-token
// sequence, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (keys 384.. attended by none of
// its queries). GQA, Dh 64 and 128.
TEST(AttentionCudaRuns, ZigzagTwoRanks) {
  KEEL_REQUIRE_GPU();
  for (const int dh : {64, 128}) {
    check_runs({2, 512, 4, 2, dh, {0, 384}, 128}, 1100 + dh);
    check_runs({2, 512, 4, 2, dh, {128, 256}, 128}, 1200 + dh);
  }
}

// A C = 3-like rank: chunks 1 and 4 of six chunks of 128 (keys 768.. beyond, 256..639 between
// the runs).
TEST(AttentionCudaRuns, ThreeRanksLike) {
  KEEL_REQUIRE_GPU();
  for (const int dh : {64, 128}) check_runs({2, 768, 4, 2, dh, {128, 640}, 128}, 1300 + dh);
}

// A window of 100 crossing run boundaries (a run's first queries see keys of the chunk before,
// held by another rank), and wholly before the later run's first window.
TEST(AttentionCudaRuns, SlidingWindowAcrossRuns) {
  KEEL_REQUIRE_GPU();
  for (const int dh : {64, 128}) {
    check_runs({2, 512, 4, 2, dh, {0, 384}, 128, 100}, 1400 + dh);
    check_runs({2, 512, 4, 2, dh, {128, 256}, 128, 100}, 1500 + dh);
    check_runs({2, 768, 4, 2, dh, {128, 640}, 128, 100}, 1600 + dh);
  }
}

// Runs of lengths that are no multiple of any tile, runs in any order, overlapping runs (their dk,
// dv summed), one run and eight, MHA and GQA, windows inside a tile and over several.
TEST(AttentionCudaRuns, OddRunsAnyOrder) {
  KEEL_REQUIRE_GPU();
  check_runs({2, 300, 4, 4, 64, {223, 0}, 77}, 1701);
  check_runs({1, 300, 8, 2, 128, {5, 130, 250}, 50, 37}, 1702);
  check_runs({2, 200, 4, 2, 64, {10, 40}, 64}, 1703);
  check_runs({2, 200, 4, 2, 128, {10, 40}, 64, 13}, 1704);
  check_runs({1, 333, 4, 2, 128, {200}, 133, 129}, 1705);
  check_runs({1, 400, 4, 2, 64, {0, 390, 17, 200, 64, 129, 300, 333}, 10}, 1706);
  check_runs({2, 3, 4, 4, 64, {2}, 1}, 1707);
}

// One run at 0 with Tq == Tk is forward()/backward(): forward bit for bit (no atomics: each
// block's arithmetic is the same). Backward sums dq and, for GQA, dk/dv with fp32 atomics in no
// fixed order, so it is bit for bit only where every element gets a single addend (MHA, T <= 128:
// one key tile) and elsewhere equal up to that order (within a bf16 rounding step). The fp32 dk,
// dv rounded to bf16 are backward's bf16 dk, dv.
TEST(AttentionCudaRuns, OneRunEqualsForwardBackward) {
  KEEL_REQUIRE_GPU();
  struct Case {
    Shape s;
    int window;
    bool bitwise_backward;
  };
  const Case cases[] = {{{2, 128, 4, 4, 64}, 0, true},  {{2, 77, 4, 4, 128}, 0, true},   {{2, 128, 4, 4, 128}, 50, true},
                        {{2, 200, 8, 2, 128}, 0, false}, {{2, 200, 8, 2, 64}, 65, false}, {{1, 333, 4, 2, 64}, 0, false},
                        {{1, 333, 4, 4, 128}, 100, false}};
  std::uint64_t seed = 1800;
  for (const Case& c : cases) {
    const Shape& s = c.s;
    SCOPED_TRACE(name(s) + " window=" + std::to_string(c.window));
    const float scale = 1.f / std::sqrt(static_cast<float>(s.Dh));
    const Inputs in = make_inputs(s, seed += 10);
    const std::size_t nq = in.q.size(), nkv = in.k.size(), nl = static_cast<std::size_t>(s.B) * s.Hq * s.T;
    auto q = to_device<Bf16>(in.q), k = to_device<Bf16>(in.k), v = to_device<Bf16>(in.v);
    auto dout = to_device<Bf16>(in.dout);
    const std::vector<int> run0 = {0};

    auto out1 = to_device<Bf16>(std::vector<float>(nq, 1e4f)), out2 = to_device<Bf16>(std::vector<float>(nq, 1e4f));
    auto lse1 = to_device<float>(std::vector<float>(nl, 1e4f)), lse2 = to_device<float>(std::vector<float>(nl, 1e4f));
    gpu::forward(q.get(), k.get(), v.get(), out1.get(), lse1.get(), s.B, s.T, s.Hq, s.Hkv, s.Dh, scale, c.window,
                 nullptr);
    gpu::forward_runs(q.get(), k.get(), v.get(), out2.get(), lse2.get(), s.B, s.T, s.T, s.Hq, s.Hkv, s.Dh, scale,
                      c.window, run0.data(), 1, nullptr);
    KEEL_CUDA_CHECK(cudaGetLastError());
    EXPECT_EQ(to_host(out2), to_host(out1)) << "out";
    EXPECT_EQ(to_host(lse2), to_host(lse1)) << "lse";

    // Both backwards from forward()'s out and lse.
    auto dq1 = to_device<Bf16>(std::vector<float>(nq, 1e4f)), dq2 = to_device<Bf16>(std::vector<float>(nq, 1e4f));
    auto dk1 = to_device<Bf16>(std::vector<float>(nkv, 1e4f)), dv1 = to_device<Bf16>(std::vector<float>(nkv, 1e4f));
    auto dk2 = to_device<float>(std::vector<float>(nkv, 1e4f)), dv2 = to_device<float>(std::vector<float>(nkv, 1e4f));
    const std::size_t ws1_bytes = gpu::backward_workspace_bytes(s.B, s.T, s.Hq, s.Hkv, s.Dh);
    const std::size_t ws2_bytes = gpu::backward_runs_workspace_bytes(s.B, s.T, s.T, s.Hq, s.Hkv, s.Dh);
    DeviceArray<unsigned char> ws1(ws1_bytes), ws2(ws2_bytes);
    KEEL_CUDA_CHECK(cudaMemset(ws1.get(), 0x7f, ws1_bytes));
    KEEL_CUDA_CHECK(cudaMemset(ws2.get(), 0x7f, ws2_bytes));
    gpu::backward(q.get(), k.get(), v.get(), out1.get(), lse1.get(), dout.get(), dq1.get(), dk1.get(), dv1.get(),
                  ws1.get(), s.B, s.T, s.Hq, s.Hkv, s.Dh, scale, c.window, nullptr);
    gpu::backward_runs(q.get(), k.get(), v.get(), out1.get(), lse1.get(), dout.get(), dq2.get(), dk2.get(), dv2.get(),
                       ws2.get(), s.B, s.T, s.T, s.Hq, s.Hkv, s.Dh, scale, c.window, run0.data(), 1, nullptr);
    KEEL_CUDA_CHECK(cudaGetLastError());
    const std::vector<float> dk2_bf16 = rounded_bf16(to_host(dk2)), dv2_bf16 = rounded_bf16(to_host(dv2));
    const struct {
      const char* what;
      std::vector<float> got, want;
    } grads[] = {{"dq", to_host(dq2), to_host(dq1)}, {"dk", dk2_bf16, to_host(dk1)}, {"dv", dv2_bf16, to_host(dv1)}};
    for (const auto& g : grads) {
      if (c.bitwise_backward)
        EXPECT_EQ(g.got, g.want) << g.what;
      else
        EXPECT_TRUE(all_close(g.got, g.want, 1e-2f, 1e-4f, g.what));
    }
  }
}

// No queries (Tq = 0): nothing to attend, dk and dv overwritten with zeros.
TEST(AttentionCudaRuns, NoQueriesZeroDkDv) {
  KEEL_REQUIRE_GPU();
  const int B = 2, Tk = 64, Hkv = 2, Dh = 64;
  const std::size_t nkv = static_cast<std::size_t>(B) * Tk * Hkv * Dh;
  DeviceArray<Bf16> x(nkv);
  DeviceArray<float> l(64);
  DeviceArray<unsigned char> ws(4096);
  auto dk = to_device<float>(std::vector<float>(nkv, 1e4f)), dv = to_device<float>(std::vector<float>(nkv, 1e4f));
  const int starts[] = {0, 64};
  EXPECT_EQ(gpu::backward_runs_workspace_bytes(B, 0, Tk, 4, Hkv, Dh), 0u);
  gpu::forward_runs(x.get(), x.get(), x.get(), x.get(), l.get(), B, 0, Tk, 4, Hkv, Dh, 0.1f, 0, starts, 2, nullptr);
  gpu::backward_runs(x.get(), x.get(), x.get(), x.get(), l.get(), x.get(), x.get(), dk.get(), dv.get(), ws.get(), B, 0,
                     Tk, 4, Hkv, Dh, 0.1f, 0, starts, 2, nullptr);
  KEEL_CUDA_CHECK(cudaGetLastError());
  EXPECT_EQ(to_host(dk), std::vector<float>(nkv, 0.f));
  EXPECT_EQ(to_host(dv), std::vector<float>(nkv, 0.f));
}

TEST(AttentionCudaRuns, RejectsBadRuns) {
  KEEL_REQUIRE_GPU();
  // Big enough for every shape below (B = 1, Tq <= 64, Tk = 64, Hq = Hkv = 2, Dh = 64), so a
  // check that failed to throw would not write out of bounds; the outputs apart from the inputs
  // (x: q, k, v, dout; zeros) for the calls that are fine.
  DeviceArray<Bf16> x(1 << 14), out(1 << 14), dq(1 << 14);
  DeviceArray<float> l(1 << 14), dk(1 << 14), dv(1 << 14);
  DeviceArray<unsigned char> ws(1 << 20);
  auto fwd = [&](int Tq, int Tk, const int* starts, int runs, int Dh = 64, int Hq = 2, int window = 0) {
    gpu::forward_runs(x.get(), x.get(), x.get(), out.get(), l.get(), 1, Tq, Tk, Hq, 2, Dh, 0.1f, window, starts, runs,
                      nullptr);
  };
  auto bwd = [&](int Tq, int Tk, const int* starts, int runs, int Dh = 64, int Hq = 2, int window = 0) {
    gpu::backward_runs(x.get(), x.get(), x.get(), out.get(), l.get(), x.get(), dq.get(), dk.get(), dv.get(), ws.get(),
                       1, Tq, Tk, Hq, 2, Dh, 0.1f, window, starts, runs, nullptr);
  };
  const int zero[] = {0, 0, 0, 0, 0, 0, 0, 0, 0}, neg[] = {-1}, late[] = {33}, two[] = {0, 32};
  for (const auto& call : {std::function<void(int, int, const int*, int, int, int, int)>(fwd),
                           std::function<void(int, int, const int*, int, int, int, int)>(bwd)}) {
    EXPECT_THROW(call(32, 64, zero, 0, 64, 2, 0), Error);   // runs < 1
    EXPECT_THROW(call(36, 64, zero, 9, 64, 2, 0), Error);   // runs > 8
    EXPECT_THROW(call(32, 64, nullptr, 1, 64, 2, 0), Error);  // no run_start
    EXPECT_THROW(call(32, 64, neg, 1, 64, 2, 0), Error);    // run_start < 0
    EXPECT_THROW(call(32, 64, late, 1, 64, 2, 0), Error);   // run_start + L > Tk
    EXPECT_THROW(call(33, 64, two, 2, 64, 2, 0), Error);    // Tq % runs
    EXPECT_THROW(call(32, -1, zero, 1, 64, 2, 0), Error);   // Tk < 0
    EXPECT_THROW(call(32, 64, zero, 1, 96, 2, 0), Error);   // head dim
    EXPECT_THROW(call(32, 64, zero, 1, 64, 3, 0), Error);   // Hq % Hkv
    EXPECT_THROW(call(32, 64, zero, 1, 64, 2, -1), Error);  // window
  }
  EXPECT_THROW(gpu::backward_runs_workspace_bytes(1, 32, -1, 2, 2, 64), Error);
  EXPECT_THROW(gpu::backward_runs_workspace_bytes(1, 32, 64, 3, 2, 64), Error);
  EXPECT_THROW(gpu::backward_runs_workspace_bytes(1, 32, 64, 2, 2, 32), Error);
  // The edges that are fine: a run ending at the last key, eight runs.
  const int end[] = {32}, eight[] = {0, 8, 16, 24, 32, 40, 48, 56};
  EXPECT_NO_THROW(fwd(32, 64, end, 1));
  EXPECT_NO_THROW(bwd(32, 64, end, 1));
  EXPECT_NO_THROW(fwd(64, 64, eight, 8));
  EXPECT_NO_THROW(bwd(64, 64, eight, 8));
  KEEL_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace keel

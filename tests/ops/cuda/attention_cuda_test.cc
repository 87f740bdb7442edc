// The CUDA flash attention against the fp32 CPU reference (ops/attention.h) on bf16-rounded
// random inputs, full causal and with sliding windows, plus a timing of the training shape
// (printed, not asserted).
#include "ops/cuda/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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

TEST(AttentionCudaPerf, Forward4096) {
  KEEL_REQUIRE_GPU();
  time_and_spot_check(0);
}

// A quarter of the sequence: about 7/16 of the causal FLOPs, so about that share of the time.
TEST(AttentionCudaPerf, SlidingWindow1024Of4096) {
  KEEL_REQUIRE_GPU();
  time_and_spot_check(1024);
}

}  // namespace
}  // namespace keel

// The CUDA CCA block over a sequence split (ops/cuda/sequence_split.h; ops/cuda/cca.h), the GPU
// twin of the CPU tests CcaSplit.* (tests/ops/cca_test.cc):
//   - a test-only split that holds whole sequences as S adjacent runs in ONE process (halo: run
//     s-1's tail copied into run s's halo on the device, zeros for s = 0; halo_backward its
//     adjoint; attention the base class's whole-sequence attention, right because the runs are
//     adjacent and complete) gives the results of no split, to fp32 / bf16 rounding (the grouped
//     conv's GEMMs run per run, and the conv's dx sums its taps in another order);
//   - the GPU op with that split against the CPU op with the CPU twin of the split, at
//     CcaCuda.ForwardAndBackwardMatchCpu's tolerances (zaya_ops_cuda_test.cc);
//   - zero halos change the second run's first token; the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "../adjacent_runs.h"
#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cca.h"
#include "ops/cuda/cca.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/sequence_split.h"
#include "ops/rope.h"
#include "ops/sequence_split.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

using cuda_bf16 = __nv_bfloat16;
using test::all_close;
using test::DeviceArray;
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
namespace ca = ops::cca;
namespace kca = ops::cuda::cca;


// ---------------------------------------------------------------- the splits

// GPU: whole sequences held by ONE process as S adjacent runs (rows b * S + s). The halo
// exchange is device-to-device copies on the stream; attention is the base class's. Counts the
// calls (one halo exchange per forward, one halo_backward per backward).
class AdjacentRunsCuda : public ops::cuda::SequenceSplit {
 public:
  using bf16 = ops::cuda::bf16;
  explicit AdjacentRunsCuda(int S) : S_(S) {}
  int segments() const override { return S_; }
  void halo(const bf16* tails, bf16* halos, std::int64_t rows, std::int64_t F, cudaStream_t stream) override {
    ++halo_calls;
    EXPECT_EQ(rows % S_, 0) << "halo rows";
    const std::size_t row = static_cast<std::size_t>(F) * sizeof(bf16);
    for (std::int64_t b = 0; b < rows / S_; ++b) {
      bf16* h = halos + b * S_ * F;
      KEEL_CUDA_CHECK(cudaMemsetAsync(h, 0, row, stream));
      if (S_ > 1)
        KEEL_CUDA_CHECK(cudaMemcpyAsync(h + F, tails + b * S_ * F, (S_ - 1) * row, cudaMemcpyDeviceToDevice, stream));
    }
  }
  void halo_backward(const float* dhalos, float* dtails, std::int64_t rows, std::int64_t F,
                     cudaStream_t stream) override {
    ++halo_backward_calls;
    EXPECT_EQ(rows % S_, 0) << "halo_backward rows";
    const std::size_t row = static_cast<std::size_t>(F) * sizeof(float);
    for (std::int64_t b = 0; b < rows / S_; ++b) {
      float* t = dtails + b * S_ * F;
      if (S_ > 1)
        KEEL_CUDA_CHECK(cudaMemcpyAsync(t, dhalos + b * S_ * F + F, (S_ - 1) * row, cudaMemcpyDeviceToDevice, stream));
      KEEL_CUDA_CHECK(cudaMemsetAsync(t + (S_ - 1) * F, 0, row, stream));
    }
  }
  void forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T, int Hq, int Hkv,
               int Dh, float scale, int window, cudaStream_t stream) override {
    ++forward_calls;
    SequenceSplit::forward(q, k, v, out, lse, B, T, Hq, Hkv, Dh, scale, window, stream);
  }
  void backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                bf16* dq, bf16* dk, bf16* dv, void* workspace, int B, int T, int Hq, int Hkv, int Dh, float scale,
                int window, cudaStream_t stream) override {
    ++backward_calls;
    SequenceSplit::backward(q, k, v, out, lse, dout, dq, dk, dv, workspace, B, T, Hq, Hkv, Dh, scale, window, stream);
  }
  int halo_calls = 0, halo_backward_calls = 0, forward_calls = 0, backward_calls = 0;

 private:
  int S_;
};

// Two runs whose halos are always zeros (the base class's halo): what an ignored halo would give.
class ZeroHalosCuda : public ops::cuda::SequenceSplit {
 public:
  int segments() const override { return 2; }
};

// A split that reports no runs, and one whose attention needs more workspace than CCA's scratch.
class NoSegments : public ops::cuda::SequenceSplit {
 public:
  int segments() const override { return 0; }
};
class GreedyWorkspace : public AdjacentRunsCuda {
 public:
  GreedyWorkspace() : AdjacentRunsCuda(2) {}
  std::size_t backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh) const override {
    return SequenceSplit::backward_workspace_bytes(B, T, Hq, Hkv, Dh) + 1;
  }
};

// CPU: the same (tests/ops/adjacent_runs.h).
using test::AdjacentRuns;

// ---------------------------------------------------------------- one case, CPU and GPU

struct SplitShape {
  std::int64_t B, T, H, nq, nkv, d;
  int W0, W1;
  float l2_eps = 0.f;
  std::int64_t shift_begin = -1, shift_end = -1;  // Config::v_shift_*: -1, the second half
  int window = 0;
};

std::string describe(const SplitShape& s) {
  return "B " + std::to_string(s.B) + " T " + std::to_string(s.T) + " H " + std::to_string(s.H) + " nq " +
         std::to_string(s.nq) + " nkv " + std::to_string(s.nkv) + " d " + std::to_string(s.d) + " W " +
         std::to_string(s.W0) + "," + std::to_string(s.W1) + " shift [" + std::to_string(s.shift_begin) + ", " +
         std::to_string(s.shift_end) + ") window " + std::to_string(s.window);
}

const char* const kNames[] = {"w_qk", "w_v", "conv0_w", "conv0_b", "conv1_w", "conv1_b", "temp", "w_o"};

// Inputs and parameters as CcaCuda.ForwardAndBackwardMatchCpu's (same seeds and ranges), on
// the host and the device.
struct SplitCase {
  ca::Config c;
  std::int64_t B, T, N, H, d, C, nq, nkv, W0, W1;
  ops::rope::Table rt;
  // order: w_qk w_v conv0_w conv0_b conv1_w conv1_b temp w_o (GEMM weights rounded to bf16)
  std::vector<std::vector<float>> p, g0;
  std::vector<float> x, dy;
  std::vector<std::int32_t> pos;
  DeviceArray<cuda_bf16> d_x, d_dy, d_wqk, d_wv, d_wo;
  DeviceArray<float> d_c0w, d_c0b, d_c1w, d_c1b, d_temp;
  DeviceArray<std::int32_t> d_pos;
  std::unique_ptr<ops::cuda::rope::UploadedTable> d_rt;
  kca::Weights w;

  explicit SplitCase(const SplitShape& cs)
      : B(cs.B), T(cs.T), N(cs.B * cs.T), H(cs.H), d(cs.d), nq(cs.nq), nkv(cs.nkv), W0(cs.W0), W1(cs.W1) {
    c.hidden = cs.H, c.q_heads = cs.nq, c.kv_heads = cs.nkv, c.head_dim = cs.d;
    c.conv0_width = cs.W0, c.conv1_width = cs.W1, c.l2_eps = cs.l2_eps;
    c.v_shift_begin = cs.shift_begin, c.v_shift_end = cs.shift_end;
    c.window = cs.window;
    C = c.qk_channels();
    rt = ops::rope::make_table(int(d), 0.5, 10000.0, 128);
    const float sh = 1.f / std::sqrt(float(H));
    p = {rounded_bf16(random_vector(C * H, 700, -sh, sh)),
         rounded_bf16(random_vector(nkv * d * H, 701, -sh, sh)),
         random_vector(C * W0, 702, -0.8f, 0.8f),
         random_vector(C, 703, -0.3f, 0.3f),
         random_vector(C * d * W1, 704, -0.5f / std::sqrt(float(d)), 0.5f / std::sqrt(float(d))),
         random_vector(C, 705, -0.3f, 0.3f),
         random_vector(nkv, 706, 0.5f, 1.5f),
         rounded_bf16(random_vector(H * nq * d, 707, -1.f / std::sqrt(float(nq * d)), 1.f / std::sqrt(float(nq * d))))};
    for (std::size_t i = 0; i < p.size(); ++i) g0.push_back(random_vector(p[i].size(), 730 + i, -0.1f, 0.1f));
    x = rounded_bf16(random_vector(N * H, 710));
    dy = rounded_bf16(random_vector(N * H, 720));
    for (std::int64_t i = 0; i < N; ++i) pos.push_back(static_cast<std::int32_t>(i % T));

    d_x = to_device<cuda_bf16>(x), d_dy = to_device<cuda_bf16>(dy);
    d_wqk = to_device<cuda_bf16>(p[0]), d_wv = to_device<cuda_bf16>(p[1]), d_wo = to_device<cuda_bf16>(p[7]);
    d_c0w = to_device<float>(p[2]), d_c0b = to_device<float>(p[3]), d_c1w = to_device<float>(p[4]);
    d_c1b = to_device<float>(p[5]), d_temp = to_device<float>(p[6]);
    d_pos = upload_raw(pos);
    d_rt = std::make_unique<ops::cuda::rope::UploadedTable>(rt);
    w.w_qk = d_wqk.get(), w.w_v = d_wv.get(), w.w_o = d_wo.get();
    w.conv0_w = d_c0w.get(), w.conv0_b = d_c0b.get(), w.conv1_w = d_c1w.get(), w.conv1_b = d_c1b.get();
    w.temp = d_temp.get();
  }

  ca::Params view(std::vector<std::vector<float>>& v) const {
    ca::Params q;
    q.w_qk = Tensor(v[0].data(), {C, H});
    q.w_v = Tensor(v[1].data(), {nkv * d, H});
    q.conv0_w = Tensor(v[2].data(), {C, W0});
    q.conv0_b = Tensor(v[3].data(), {C});
    q.conv1_w = Tensor(v[4].data(), {C, d, W1});
    q.conv1_b = Tensor(v[5].data(), {C});
    q.temp = Tensor(v[6].data(), {nkv});
    q.w_o = Tensor(v[7].data(), {H, c.att_heads() * d});
    return q;
  }

  // Attend query heads [q0, q0 + n) only (Config::attend_q): W_o becomes their columns.
  void attend(std::int64_t q0, std::int64_t n) {
    std::vector<float> wo(static_cast<std::size_t>(H * n * d));
    for (std::int64_t i = 0; i < H; ++i)
      for (std::int64_t j = 0; j < n * d; ++j) wo[i * n * d + j] = p[7][i * nq * d + q0 * d + j];
    c.attend_q0 = q0, c.attend_q = n;
    p[7] = wo;
    g0[7].resize(wo.size());
    d_wo = to_device<cuda_bf16>(p[7]);
    w.w_o = d_wo.get();
  }
};

// What a GPU forward + backward leaves: outputs, some saved tensors, gradient increments.
struct GpuRun {
  std::vector<float> y, dx, qk0, qk, q, k, v, att, halo;
  std::vector<std::vector<float>> g;  // kNames order, minus the starting values
};

// Forward then backward of k through `split` (null: no split), with Saved and scratch sized for
// its segments and poisoned (0x41 bytes: ~12 in fp32 and bf16) so a region read before it is
// written shows.
GpuRun run_gpu(SplitCase& k, ops::cuda::SequenceSplit* split) {
  auto& gemm = ops::cuda::thread_gemm();
  const int S = split ? split->segments() : 0;
  const std::int64_t B = k.B, T = k.T, N = k.N, H = k.H, C = k.C;
  DeviceArray<unsigned char> d_saved(kca::saved_bytes(k.c, B, T, S));
  if (d_saved.size()) KEEL_CUDA_CHECK(cudaMemset(d_saved.get(), 0x41, d_saved.size()));
  const kca::Saved s = kca::carve_saved(k.c, B, T, d_saved.get(), S);
  DeviceArray<cuda_bf16> d_y(N * H), d_dx(N * H);
  kca::forward(gemm, k.c, B, T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s, d_y.get(), nullptr, split);
  GpuRun r;
  r.y = to_host(d_y);
  r.qk0 = download_bf16(s.qk0, N * C);
  r.qk = download_f32(s.qk, N * C);
  r.q = download_bf16(s.q, N * k.nq * k.d);
  r.k = download_bf16(s.k, N * k.nkv * k.d);
  r.v = download_bf16(s.v, N * k.nkv * k.d);
  r.att = download_bf16(s.att, N * k.c.att_heads() * k.d);
  if (S > 0) r.halo = download_bf16(s.halo, B * S * ca::halo_floats(k.c));

  std::vector<DeviceArray<float>> d_g;
  for (auto& v : k.g0) d_g.push_back(to_device<float>(v));
  kca::Grads gr;
  gr.w_qk = d_g[0].get(), gr.w_v = d_g[1].get(), gr.conv0_w = d_g[2].get(), gr.conv0_b = d_g[3].get();
  gr.conv1_w = d_g[4].get(), gr.conv1_b = d_g[5].get(), gr.temp = d_g[6].get(), gr.w_o = d_g[7].get();
  DeviceArray<unsigned char> d_scratch(kca::backward_scratch_bytes(k.c, B, T, S));
  if (d_scratch.size()) KEEL_CUDA_CHECK(cudaMemset(d_scratch.get(), 0x41, d_scratch.size()));
  kca::backward(gemm, k.c, B, T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s, k.d_dy.get(), d_dx.get(), gr,
                d_scratch.get(), nullptr, split);
  r.dx = to_host(d_dx);
  for (std::size_t i = 0; i < d_g.size(); ++i) r.g.push_back(minus(to_host(d_g[i]), k.g0[i]));
  return r;
}

// The CPU op's forward then backward of k through `split` (null: whole sequences), and the scale
// of its dtemp: sqrt(d) sum_n |g_n| per kv head with g the post-RoPE-inverse dk (the CPU scratch
// layout: datt [N, na d], dq [N, nq d], then dk), as CcaCuda.ForwardAndBackwardMatchCpu.
struct CpuRun {
  std::vector<float> y, dx, saved_buf;
  ca::Saved sv;
  std::vector<std::vector<float>> g;  // minus the starting values
  std::vector<double> temp_scale;
};

CpuRun run_cpu(SplitCase& k, ops::SequenceSplit* split) {
  const int S = split ? split->segments() : 0;
  const std::int64_t B = k.B, T = k.T, N = k.N, H = k.H, d = k.d, nq = k.nq, nkv = k.nkv;
  CpuRun r;
  r.y.resize(N * H);
  r.dx.resize(N * H);
  r.saved_buf.resize(ca::saved_floats(k.c, B, T, S));
  r.sv = ca::carve_saved(k.c, B, T, r.saved_buf.data(), S);
  ca::forward(k.c, B, T, Tensor(k.x.data(), {N, H}), k.pos.data(), k.rt, k.view(k.p), r.sv,
              Tensor(r.y.data(), {N, H}), split);
  auto g = k.g0;
  std::vector<float> scratch(ca::backward_scratch_floats(k.c, B, T, S));
  ca::backward(k.c, B, T, Tensor(k.x.data(), {N, H}), k.pos.data(), k.rt, k.view(k.p), r.sv,
               Tensor(k.dy.data(), {N, H}), Tensor(r.dx.data(), {N, H}), k.view(g),
               Tensor(scratch.data(), {std::int64_t(scratch.size())}), split);
  for (std::size_t i = 0; i < g.size(); ++i) r.g.push_back(minus(g[i], k.g0[i]));
  r.temp_scale.assign(nkv, 0.0);
  const float* dk = scratch.data() + N * (k.c.att_heads() + nq) * d;
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t gk = 0; gk < nkv; ++gk) {
      double ss = 0;
      for (std::int64_t i = 0; i < d; ++i) ss += double(dk[(n * nkv + gk) * d + i]) * dk[(n * nkv + gk) * d + i];
      r.temp_scale[gk] += std::sqrt(double(d)) * std::sqrt(ss);
    }
  return r;
}

// |got - want| <= tol * scale per kv head (dtemp is a sum over tokens that may cancel).
void expect_dtemp(const std::vector<float>& got, const std::vector<float>& want, const std::vector<double>& scale,
                  double tol) {
  for (std::size_t gk = 0; gk < scale.size(); ++gk) {
    std::printf("    dtemp[%d] got %.5g want %.5g (scale %.3g)\n", int(gk), got[gk], want[gk], scale[gk]);
    EXPECT_LE(std::fabs(double(got[gk]) - want[gk]), tol * scale[gk])
        << "dtemp[" << gk << "] got " << got[gk] << " want " << want[gk] << " scale " << scale[gk];
  }
}

// The rows [t0, t0 + n) of every sequence of v [B, T, width].
std::vector<float> seq_rows(const std::vector<float>& v, std::int64_t B, std::int64_t T, std::int64_t width,
                            std::int64_t t0, std::int64_t n) {
  std::vector<float> out;
  for (std::int64_t b = 0; b < B; ++b)
    out.insert(out.end(), v.begin() + (b * T + t0) * width, v.begin() + (b * T + t0 + n) * width);
  return out;
}

// Split vs no split on the GPU: only fp32 summation orders differ (the grouped conv's GEMMs per
// run, the conv's dx taps split between the run and its halo's gradient), each occasionally
// flipping a bf16 rounding: norm-relative 2e-3 bounds that by far (a halo ignored or misplaced
// gives ~1e-1 at y, more at some gradients).
constexpr double kSplitTol = 2e-3;

// temp_scale: the CPU's dtemp scale (run_cpu) for the sum over tokens dtemp is.
void expect_equal_runs(const GpuRun& split, const GpuRun& whole, const std::vector<double>& temp_scale,
                       const std::string& tag) {
  EXPECT_LT(logged_rel_err("y", split.y, whole.y), kSplitTol) << tag << ": y";
  EXPECT_LT(logged_rel_err("dx", split.dx, whole.dx), kSplitTol) << tag << ": dx";
  for (int i = 0; i < 8; ++i) {
    if (i == 6)
      expect_dtemp(split.g[i], whole.g[i], temp_scale, kSplitTol);
    else
      EXPECT_LT(logged_rel_err(kNames[i], split.g[i], whole.g[i]), kSplitTol) << tag << ": d" << kNames[i];
    double mag = 0;
    for (float e : whole.g[i]) mag += std::fabs(e);
    EXPECT_GT(mag, 0.0) << tag << ": d" << kNames[i] << " is zero";
  }
}

// ---------------------------------------------------------------- tests

TEST(CcaSplitCuda, AdjacentRunsEqualNoSplit) {
  KEEL_REQUIRE_GPU();
  struct Case {
    SplitShape shape;
    int S;
  };
  // ZAYA1-tiny (hidden 256, 4 q heads x 64, 2 kv heads, conv widths 2) in 2 and 3 runs; GQA 8/2
  // with a 3-wide depthwise conv; head dim 128 with a 3-wide grouped conv and l2_eps; the value
  // shift ranges of tensor-parallel ranks (all columns, none: a halo of qk0 rows only, inside a
  // head); a sliding window; 1-wide convs (a halo of value columns only); runs exactly as long as
  // the halo (L = hh = 3).
  for (const Case& cs : {Case{{2, 36, 256, 4, 2, 64, 2, 2}, 2}, Case{{2, 36, 256, 4, 2, 64, 2, 2}, 3},
                        Case{{2, 36, 192, 8, 2, 64, 3, 2}, 2}, Case{{2, 36, 192, 8, 2, 64, 3, 2}, 3},
                        Case{{1, 36, 128, 2, 1, 128, 2, 3, 1e-3f}, 3},
                        Case{{2, 36, 256, 4, 2, 64, 2, 2, 0.f, 0, 128}, 3},
                        Case{{2, 36, 256, 4, 2, 64, 2, 2, 0.f, 128, 128}, 2},
                        Case{{1, 36, 128, 2, 1, 128, 2, 3, 1e-3f, 32, 96}, 2},
                        Case{{2, 36, 256, 4, 2, 64, 3, 2, 0.f, -1, -1, 5}, 2},
                        Case{{2, 36, 256, 4, 2, 64, 1, 1}, 2},
                        Case{{2, 6, 192, 8, 2, 64, 3, 2}, 2}}) {
    const std::string tag = describe(cs.shape) + " S " + std::to_string(cs.S);
    SCOPED_TRACE(tag);
    SplitCase k(cs.shape);
    const GpuRun whole = run_gpu(k, nullptr);
    AdjacentRunsCuda split(cs.S);
    const GpuRun runs = run_gpu(k, &split);
    EXPECT_EQ(split.halo_calls, ca::halo_floats(k.c) > 0 ? 1 : 0);
    EXPECT_EQ(split.halo_backward_calls, ca::halo_floats(k.c) > 0 ? 1 : 0);
    EXPECT_EQ(split.forward_calls, 1);
    EXPECT_EQ(split.backward_calls, 1);

    // The projections are the same GEMMs on the same x: qk0 and the (shifted) values agree to
    // bf16 rounding. Each run's halo: the previous run's last hh qk0 rows (copies: exact), then
    // its last token's unshifted values, i.e. the shifted values of this run's first token in
    // the whole sequence; zeros for a sequence's first run.
    EXPECT_TRUE(all_close(runs.qk0, whole.qk0, 4e-3f, 1e-6f, "qk0"));
    EXPECT_TRUE(all_close(runs.v, whole.v, 4e-3f, 1e-6f, "v (shifted values)"));
    const std::int64_t R = k.B * cs.S, L = k.T / cs.S, F = ca::halo_floats(k.c), hh = (k.W0 - 1) + (k.W1 - 1),
                       hc = hh * k.C, dk = k.nkv * k.d, lo = k.c.shift_begin(), width = F - hc;
    ASSERT_EQ(runs.halo.size(), std::size_t(R * F));
    std::vector<float> got_qk0, want_qk0, got_u, want_u;
    for (std::int64_t r = 0; r < R; ++r) {
      const bool first = r % cs.S == 0;
      for (std::int64_t j = 0; j < hc; ++j) {
        got_qk0.push_back(runs.halo[r * F + j]);
        want_qk0.push_back(first ? 0.f : runs.qk0[((r - 1) * L + L - hh) * k.C + j]);
      }
      for (std::int64_t j = 0; j < width; ++j) {
        got_u.push_back(runs.halo[r * F + hc + j]);
        want_u.push_back(first ? 0.f : whole.v[(r * L) * dk + lo + j]);
      }
    }
    EXPECT_TRUE(all_close(got_qk0, want_qk0, 0.f, 0.f, "halo qk0 rows"));
    EXPECT_TRUE(all_close(got_u, want_u, 4e-3f, 1e-6f, "halo value columns"));

    EXPECT_LT(logged_rel_err("qk", runs.qk, whole.qk), kSplitTol) << "qk (pre-norm)";
    expect_equal_runs(runs, whole, run_cpu(k, nullptr).temp_scale, tag);
  }
}

// The base split (whole sequences, segments 1): zero halos, the same results as no split.
TEST(CcaSplitCuda, WholeSequencesSplitEqualsNoSplit) {
  KEEL_REQUIRE_GPU();
  for (const SplitShape& sh : {SplitShape{2, 37, 256, 4, 2, 64, 2, 2}, SplitShape{2, 37, 192, 8, 2, 64, 3, 2}}) {
    SCOPED_TRACE(describe(sh));
    SplitCase k(sh);
    const GpuRun whole = run_gpu(k, nullptr), one = run_gpu(k, &ops::cuda::whole_sequences());
    expect_equal_runs(one, whole, run_cpu(k, nullptr).temp_scale, describe(sh));
  }
}

// Halos of zeros (as if the halo were ignored) leave run 0 alone and change run 1's first token
// (its conv inputs and its shifted values): the equality above cannot come from an unused halo.
TEST(CcaSplitCuda, ZeroHalosDifferAtTheFirstTokenOfTheSecondRun) {
  KEEL_REQUIRE_GPU();
  for (const SplitShape& sh : {SplitShape{2, 36, 256, 4, 2, 64, 2, 2}, SplitShape{2, 36, 192, 8, 2, 64, 3, 2}}) {
    SCOPED_TRACE(describe(sh));
    SplitCase k(sh);
    const GpuRun whole = run_gpu(k, nullptr);
    ZeroHalosCuda split;
    const GpuRun zero = run_gpu(k, &split);
    const std::int64_t L = k.T / 2;
    EXPECT_LT(logged_rel_err("y run 0", seq_rows(zero.y, k.B, k.T, k.H, 0, L), seq_rows(whole.y, k.B, k.T, k.H, 0, L)),
              kSplitTol);
    for (std::int64_t b = 0; b < k.B; ++b) {
      const std::vector<float> got(zero.y.begin() + (b * k.T + L) * k.H, zero.y.begin() + (b * k.T + L + 1) * k.H),
          want(whole.y.begin() + (b * k.T + L) * k.H, whole.y.begin() + (b * k.T + L + 1) * k.H);
      EXPECT_GT(norm_rel_err(got, want), 1e-2) << "sequence " << b << ": run 1's first token ignored its halo";
    }
  }
}

// The GPU op with the adjacent-runs split against the CPU op with the CPU's, at
// CcaCuda.ForwardAndBackwardMatchCpu's tolerances (bf16 intermediates on the GPU).
TEST(CcaSplitCuda, ForwardAndBackwardMatchCpuSplit) {
  KEEL_REQUIRE_GPU();
  struct Case {
    SplitShape shape;
    int S;
  };
  for (const Case& cs : {Case{{2, 36, 256, 4, 2, 64, 2, 2}, 2}, Case{{2, 36, 192, 8, 2, 64, 3, 2}, 3},
                        Case{{1, 36, 128, 2, 1, 128, 2, 3, 1e-3f, 32, 96}, 2},
                        Case{{2, 36, 256, 4, 2, 64, 3, 2, 0.f, 0, 128, 5}, 3}}) {
    const std::string tag = describe(cs.shape) + " S " + std::to_string(cs.S);
    SCOPED_TRACE(tag);
    SplitCase k(cs.shape);

    // CPU, split into the same runs.
    AdjacentRuns cpu_split(cs.S);
    const CpuRun want = run_cpu(k, &cpu_split);
    const ca::Saved& sv = want.sv;

    AdjacentRunsCuda split(cs.S);
    const GpuRun r = run_gpu(k, &split);
    auto cpu = [](const Tensor& t) { return std::vector<float>(t.data(), t.data() + t.numel()); };
    EXPECT_LT(norm_rel_err(r.halo, cpu(sv.halo)), 1e-2) << "halo";
    EXPECT_LT(norm_rel_err(r.qk, cpu(sv.qk)), 1e-2) << "qk (pre-norm)";
    EXPECT_LT(norm_rel_err(r.q, cpu(sv.q)), 1e-2) << "q";
    EXPECT_LT(norm_rel_err(r.k, cpu(sv.k)), 1e-2) << "k";
    EXPECT_LT(norm_rel_err(r.v, cpu(sv.v)), 1e-2) << "v";
    EXPECT_LT(norm_rel_err(r.att, cpu(sv.att)), 2e-2) << "att";
    EXPECT_LT(logged_rel_err("y", r.y, want.y), 2e-2) << "y";
    EXPECT_LT(logged_rel_err("dx", r.dx, want.dx), 3e-2) << "dx";
    // The gradients: within the op's own bf16 error on this case (the GPU op against the CPU op
    // without a split; a few small ones, the conv biases of a 36-token case, reach 3e-2 there),
    // so the split adds none of its own.
    const GpuRun whole_gpu = run_gpu(k, nullptr);
    const CpuRun whole_cpu = run_cpu(k, nullptr);
    for (std::size_t i = 0; i < k.p.size(); ++i) {
      if (i == 6) {
        expect_dtemp(r.g[i], want.g[i], want.temp_scale, 1e-2);
        continue;
      }
      const double own = norm_rel_err(whole_gpu.g[i], whole_cpu.g[i]);
      EXPECT_LT(logged_rel_err(kNames[i], r.g[i], want.g[i]), std::max(3e-2, 1.5 * own)) << kNames[i];
    }
  }
}

// Config::attend_q (tensor parallelism past the kv heads): every head's projections, convolutions
// and mixing, attention of a part of the query heads with W_o's matching columns, against the
// CPU op on the same part; without and with a sequence split (context parallelism).
TEST(CcaCuda, AttendedPartMatchesCpu) {
  KEEL_REQUIRE_GPU();
  struct Case {
    std::int64_t q0, n;
    int S;
  };
  for (const Case& cs : {Case{1, 1, 0}, Case{2, 2, 0}, Case{3, 1, 2}}) {
    SplitCase k(SplitShape{2, 36, 256, 4, 2, 64, 2, 2});
    k.attend(cs.q0, cs.n);
    SCOPED_TRACE("heads [" + std::to_string(cs.q0) + ", " + std::to_string(cs.q0 + cs.n) + ") S " +
                 std::to_string(cs.S));
    AdjacentRuns cpu_split(cs.S > 0 ? cs.S : 1);
    AdjacentRunsCuda gpu_split(cs.S > 0 ? cs.S : 1);
    const CpuRun want = run_cpu(k, cs.S > 0 ? &cpu_split : nullptr);
    const GpuRun r = run_gpu(k, cs.S > 0 ? &gpu_split : nullptr);
    auto cpu = [](const Tensor& t) { return std::vector<float>(t.data(), t.data() + t.numel()); };
    EXPECT_LT(norm_rel_err(r.q, cpu(want.sv.q)), 1e-2) << "q";
    EXPECT_LT(norm_rel_err(r.k, cpu(want.sv.k)), 1e-2) << "k";
    EXPECT_LT(norm_rel_err(r.att, cpu(want.sv.att)), 2e-2) << "att";
    EXPECT_LT(logged_rel_err("y", r.y, want.y), 2e-2) << "y";
    EXPECT_LT(logged_rel_err("dx", r.dx, want.dx), 3e-2) << "dx";
    for (std::size_t i = 0; i < k.p.size(); ++i) {
      if (i == 6) {
        expect_dtemp(r.g[i], want.g[i], want.temp_scale, 1e-2);
        continue;
      }
      EXPECT_LT(logged_rel_err(kNames[i], r.g[i], want.g[i]), 3e-2) << kNames[i];
    }
  }
}

// A split's rank tokens per sequence not divisible into its runs, runs shorter than the conv
// halo, a Saved carved without the halo, a split with no runs, and a split whose attention needs
// more workspace than CCA's scratch: keel::Error before anything is launched (the split's halo
// exchange never called).
TEST(CcaSplitCuda, RejectsBadSplits) {
  KEEL_REQUIRE_GPU();
  auto& gemm = ops::cuda::thread_gemm();
  auto expect_error = [](auto&& call, const char* needle, const char* what) {
    try {
      call();
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  {
    SplitCase k(SplitShape{2, 35, 256, 4, 2, 64, 2, 2});  // 35 tokens in 2 runs
    EXPECT_THROW(kca::saved_bytes(k.c, k.B, k.T, 2), Error);
    EXPECT_THROW(kca::backward_scratch_bytes(k.c, k.B, k.T, 2), Error);
    DeviceArray<unsigned char> d_saved(kca::saved_bytes(k.c, k.B, k.T));
    const kca::Saved s = kca::carve_saved(k.c, k.B, k.T, d_saved.get());
    DeviceArray<cuda_bf16> d_y(k.N * k.H);
    AdjacentRunsCuda split(2);
    expect_error([&] { kca::forward(gemm, k.c, k.B, k.T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s,
                                    d_y.get(), nullptr, &split); },
                 "divisible", "T % S");
    EXPECT_EQ(split.halo_calls, 0);
    EXPECT_EQ(split.forward_calls, 0);
  }
  {
    SplitCase k(SplitShape{2, 4, 192, 8, 2, 64, 3, 2});  // runs of 2 tokens, halo (3-1) + (2-1) = 3
    EXPECT_THROW(kca::saved_bytes(k.c, k.B, k.T, 2), Error);
    EXPECT_THROW(kca::carve_saved(k.c, k.B, k.T, nullptr, 2), Error);
    DeviceArray<unsigned char> d_saved(kca::saved_bytes(k.c, k.B, k.T));
    const kca::Saved s = kca::carve_saved(k.c, k.B, k.T, d_saved.get());
    DeviceArray<cuda_bf16> d_y(k.N * k.H);
    AdjacentRunsCuda split(2);
    expect_error([&] { kca::forward(gemm, k.c, k.B, k.T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s,
                                    d_y.get(), nullptr, &split); },
                 "shorter than the conv halo", "L < hh");
    EXPECT_EQ(split.halo_calls, 0);
  }
  {
    SplitCase k(SplitShape{2, 36, 256, 4, 2, 64, 2, 2});
    // Saved carved without the split's segments: no halo.
    DeviceArray<unsigned char> d_saved(kca::saved_bytes(k.c, k.B, k.T));
    const kca::Saved s = kca::carve_saved(k.c, k.B, k.T, d_saved.get());
    EXPECT_EQ(s.halo, nullptr);
    DeviceArray<cuda_bf16> d_y(k.N * k.H), d_dx(k.N * k.H);
    DeviceArray<unsigned char> d_scratch(kca::backward_scratch_bytes(k.c, k.B, k.T, 2));
    AdjacentRunsCuda split(2);
    expect_error([&] { kca::forward(gemm, k.c, k.B, k.T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s,
                                    d_y.get(), nullptr, &split); },
                 "halo", "Saved without the halo (forward)");
    expect_error([&] { kca::backward(gemm, k.c, k.B, k.T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s,
                                     k.d_dy.get(), d_dx.get(), kca::Grads{}, d_scratch.get(), nullptr, &split); },
                 "halo", "Saved without the halo (backward)");
    EXPECT_EQ(split.halo_calls, 0);
    EXPECT_EQ(split.halo_backward_calls, 0);
    EXPECT_EQ(split.forward_calls + split.backward_calls, 0);

    // A split of 0 segments.
    NoSegments none;
    EXPECT_THROW(kca::forward(gemm, k.c, k.B, k.T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s, d_y.get(),
                              nullptr, &none),
                 Error);
    EXPECT_THROW(kca::saved_bytes(k.c, k.B, k.T, -1), Error);

    // A split needing more attention workspace than the scratch has: backward refuses it.
    GreedyWorkspace greedy;
    DeviceArray<unsigned char> d_saved2(kca::saved_bytes(k.c, k.B, k.T, 2));
    const kca::Saved s2 = kca::carve_saved(k.c, k.B, k.T, d_saved2.get(), 2);
    ASSERT_NE(s2.halo, nullptr);
    kca::forward(gemm, k.c, k.B, k.T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s2, d_y.get(), nullptr, &greedy);
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    expect_error([&] { kca::backward(gemm, k.c, k.B, k.T, k.d_x.get(), k.d_pos.get(), k.d_rt->view(), k.w, s2,
                                     k.d_dy.get(), d_dx.get(), kca::Grads{}, d_scratch.get(), nullptr, &greedy); },
                 "workspace", "greedy split");
    EXPECT_EQ(greedy.halo_backward_calls, 0);
    EXPECT_EQ(greedy.backward_calls, 0);
  }
}

}  // namespace
}  // namespace keel

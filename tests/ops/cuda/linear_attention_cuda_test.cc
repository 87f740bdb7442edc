// The CUDA linear attention (ops/cuda/linear_attention.h) against the CPU op (ops/linear_attention.h)
// on fresh random inputs: the GPU gets bf16 inputs, the CPU op runs in fp32 on the same rounded
// values, and bf16 outputs are compared by norm-relative error (logged). Covers no decay / decay,
// with and without an initial state and dlocal, GQA and MHA, head dims 128, 64, 32, 16 (the
// vectorized tiles), 48 and 5 (element loads into padded tiles), lengths that are not a multiple
// of the kernels' 64-token chunk, several runs, Config::chunk 1 and larger than the run (the CPU
// op's chunking; the GPU's is its own), one-token runs, misaligned pointers, runs long enough for
// the segmented scan (several segments, a short last one, a tail chunk); a leak check (a later
// token never changes an earlier output bit, across segment boundaries too); the decode step; the
// feature map and norm; determinism; the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cuda/linear_attention.h"
#include "ops/linear_attention.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

using cuda_bf16 = __nv_bfloat16;
using test::all_close;
using test::DeviceArray;
using test::download_bf16;
using test::download_f32;
using test::logged_rel_err;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
namespace la = ops::linear_attention;
namespace kla = ops::cuda::linear_attention;

// bf16 outputs against the fp32 CPU op on the same inputs: the GPU rounds its MMA operands
// (stored states, masked score tiles, decayed k / q rows) and its outputs to bf16 (~4e-3 each).
constexpr double kTol = 2e-2;

struct Shape {
  std::int64_t runs, len;
  int hq, hkv, d, chunk;
  bool decay, init, dlocal;
};

std::string describe(const Shape& s) {
  return "runs " + std::to_string(s.runs) + " len " + std::to_string(s.len) + " hq " + std::to_string(s.hq) +
         " hkv " + std::to_string(s.hkv) + " d " + std::to_string(s.d) + " chunk " + std::to_string(s.chunk) +
         (s.decay ? " decay" : "") + (s.init ? " init" : "") + (s.dlocal ? " dlocal" : "");
}

la::Config config_of(const Shape& s) {
  la::Config c;
  c.heads = s.hq;
  c.kv_heads = s.hkv;
  c.head_dim = s.d;
  c.chunk = s.chunk;
  if (s.decay) {
    const float g[] = {0.9f, 0.6f, 0.97f, 0.8f};
    for (int i = 0; i < s.hkv; ++i) c.decay.push_back(g[i % 4]);
  }
  return c;
}

// Host inputs, rounded to bf16 where the GPU reads bf16 (init and dlocal are fp32 on both).
struct Inputs {
  std::vector<float> q, k, v, dout, init, dlocal;
};

Inputs make(const Shape& s, std::uint64_t seed) {
  const std::int64_t N = s.runs * s.len, states = s.runs * s.hkv * s.d * s.d;
  Inputs x;
  x.q = rounded_bf16(random_vector(N * s.hq * s.d, seed, -0.5f, 0.5f));
  x.k = rounded_bf16(random_vector(N * s.hkv * s.d, seed + 1, -0.5f, 0.5f));
  x.v = rounded_bf16(random_vector(N * s.hkv * s.d, seed + 2));
  x.dout = rounded_bf16(random_vector(N * s.hq * s.d, seed + 3));
  if (s.init) x.init = random_vector(states, seed + 4, -0.3f, 0.3f);
  if (s.dlocal) x.dlocal = random_vector(states, seed + 5);
  return x;
}

Tensor view(std::vector<float>& v, std::initializer_list<std::int64_t> shape) {
  return v.empty() ? Tensor() : Tensor(v.data(), shape);
}

// ---------------------------------------------------------------- CPU

struct Results {
  std::vector<float> out, dq, dk, dv, dinit, states, igrad;  // igrad: init_gradient's dinit
};

Results run_cpu(const Shape& s, const la::Config& cfg, Inputs x) {
  const std::int64_t N = s.runs * s.len, qw = std::int64_t(s.hq) * s.d, kw = std::int64_t(s.hkv) * s.d;
  Results r;
  r.out.resize(N * qw);
  r.dq.resize(N * qw);
  r.dk.resize(N * kw);
  r.dv.resize(N * kw);
  r.dinit.resize(s.runs * s.hkv * s.d * s.d);
  r.states.resize(r.dinit.size());
  r.igrad.resize(r.dinit.size());
  const Tensor q = view(x.q, {N, qw}), k = view(x.k, {N, kw}), v = view(x.v, {N, kw});
  const Tensor init = view(x.init, {s.runs, s.hkv, s.d, s.d}), dlocal = view(x.dlocal, {s.runs, s.hkv, s.d, s.d});
  la::forward(cfg, s.runs, s.len, q, k, v, init, view(r.out, {N, qw}));
  la::backward(cfg, s.runs, s.len, q, k, v, init, view(x.dout, {N, qw}), dlocal, view(r.dq, {N, qw}),
               view(r.dk, {N, kw}), view(r.dv, {N, kw}), view(r.dinit, {s.runs, s.hkv, s.d, s.d}));
  la::local_states(cfg, s.runs, s.len, k, v, view(r.states, {s.runs, s.hkv, s.d, s.d}));
  la::init_gradient(cfg, s.runs, s.len, q, view(x.dout, {N, qw}), view(r.igrad, {s.runs, s.hkv, s.d, s.d}));
  return r;
}

// ---------------------------------------------------------------- GPU

// The inputs on the device, each `offset` elements into its allocation (offset 1: not 16-byte
// aligned, so the kernels take their element-wise loads); outputs poisoned (0x41 bytes) so an
// element left unwritten shows.
struct Device {
  std::int64_t offset;
  DeviceArray<cuda_bf16> q, k, v, dout, out, dq, dk, dv;
  DeviceArray<float> init, dlocal, dinit, states, igrad;
  DeviceArray<unsigned char> ws;

  static std::vector<float> padded(const std::vector<float>& h, std::int64_t offset) {
    std::vector<float> p(offset, 0.f);
    p.insert(p.end(), h.begin(), h.end());
    return p;
  }
  template <typename T>
  static DeviceArray<T> poisoned(std::size_t n) {
    DeviceArray<T> d(n);
    if (n) KEEL_CUDA_CHECK(cudaMemset(d.get(), 0x41, n * sizeof(T)));
    return d;
  }

  Device(const Shape& s, const la::Config& cfg, const Inputs& x, std::int64_t off = 0) : offset(off) {
    q = to_device<cuda_bf16>(padded(x.q, off));
    k = to_device<cuda_bf16>(padded(x.k, off));
    v = to_device<cuda_bf16>(padded(x.v, off));
    dout = to_device<cuda_bf16>(padded(x.dout, off));
    if (!x.init.empty()) init = to_device<float>(x.init);
    if (!x.dlocal.empty()) dlocal = to_device<float>(x.dlocal);
    out = poisoned<cuda_bf16>(x.q.size() + off);
    dq = poisoned<cuda_bf16>(x.q.size() + off);
    dk = poisoned<cuda_bf16>(x.k.size() + off);
    dv = poisoned<cuda_bf16>(x.v.size() + off);
    dinit = poisoned<float>(s.runs * s.hkv * s.d * s.d);
    states = poisoned<float>(s.runs * s.hkv * s.d * s.d);
    igrad = poisoned<float>(s.runs * s.hkv * s.d * s.d);
    ws = poisoned<unsigned char>(kla::workspace_bytes(cfg, s.runs, s.len));
  }
  const cuda_bf16* in(const DeviceArray<cuda_bf16>& a) const { return a.get() + offset; }
  cuda_bf16* at(DeviceArray<cuda_bf16>& a) const { return a.get() + offset; }
  std::vector<float> host(const DeviceArray<cuda_bf16>& a) const {
    std::vector<float> h = download_bf16(a.get(), a.size());
    return std::vector<float>(h.begin() + offset, h.end());
  }
};

Results run_gpu(const Shape& s, const la::Config& cfg, Device& g) {
  kla::forward(cfg, s.runs, s.len, g.in(g.q), g.in(g.k), g.in(g.v), g.init.get(), g.at(g.out), g.ws.get(), nullptr);
  kla::backward(cfg, s.runs, s.len, g.in(g.q), g.in(g.k), g.in(g.v), g.init.get(), g.in(g.dout), g.dlocal.get(),
                g.at(g.dq), g.at(g.dk), g.at(g.dv), g.dinit.get(), g.ws.get(), nullptr);
  kla::local_states(cfg, s.runs, s.len, g.in(g.k), g.in(g.v), g.states.get(), nullptr);
  kla::init_gradient(cfg, s.runs, s.len, g.in(g.q), g.in(g.dout), g.igrad.get(), nullptr);
  Results r;
  r.out = g.host(g.out);
  r.dq = g.host(g.dq);
  r.dk = g.host(g.dk);
  r.dv = g.host(g.dv);
  r.dinit = download_f32(g.dinit.get(), g.dinit.size());
  r.states = download_f32(g.states.get(), g.states.size());
  r.igrad = download_f32(g.igrad.get(), g.igrad.size());
  return r;
}

void expect_match(const Results& got, const Results& want, const std::string& tag) {
  EXPECT_LT(logged_rel_err("out", got.out, want.out), kTol) << tag << ": out";
  EXPECT_LT(logged_rel_err("dq", got.dq, want.dq), kTol) << tag << ": dq";
  EXPECT_LT(logged_rel_err("dk", got.dk, want.dk), kTol) << tag << ": dk";
  EXPECT_LT(logged_rel_err("dv", got.dv, want.dv), kTol) << tag << ": dv";
  EXPECT_LT(logged_rel_err("dinit", got.dinit, want.dinit), kTol) << tag << ": dinit";
  EXPECT_LT(logged_rel_err("local_states", got.states, want.states), kTol) << tag << ": local_states";
  EXPECT_LT(logged_rel_err("init_gradient", got.igrad, want.igrad), kTol) << tag << ": init_gradient";
  // init_gradient is backward's reverse scan without the stored states: the same bits.
  EXPECT_TRUE(all_close(got.igrad, got.dinit, 0.f, 0.f, "init_gradient vs backward's dinit")) << tag;
}

void check_shape(const Shape& s, std::uint64_t seed, std::int64_t offset = 0) {
  const std::string tag = describe(s) + (offset ? " misaligned" : "");
  SCOPED_TRACE(tag);
  std::printf("  %s\n", tag.c_str());
  const la::Config cfg = config_of(s);
  const Inputs x = make(s, seed);
  Device g(s, cfg, x, offset);
  expect_match(run_gpu(s, cfg, g), run_cpu(s, cfg, x), tag);
}

// ---------------------------------------------------------------- tests

// forward, backward, local_states and init_gradient against the CPU op.
TEST(LinearAttentionCuda, MatchesCpu) {
  KEEL_REQUIRE_GPU();
  const Shape shapes[] = {
      {1, 200, 2, 2, 64, 64, false, false, false},   // MHA, d 64, no decay, tail chunk of 8
      {2, 150, 4, 2, 128, 64, true, true, true},     // GQA 2, d 128, everything on
      {1, 77, 4, 1, 64, 1, true, true, false},       // GQA 4, CPU chunk 1
      {2, 100, 2, 2, 128, 256, false, true, true},   // CPU chunk larger than the run, no decay
      {2, 45, 4, 2, 16, 8, true, false, true},       // d 16, one partial chunk
      {3, 64, 2, 2, 32, 16, true, true, true},       // d 32, exactly one chunk, 3 runs
      {1, 130, 2, 1, 48, 64, false, true, false},    // d 48: padded to 64, element loads
      {1, 70, 3, 3, 5, 4, true, true, true},         // d 5 (the CPU tests' size)
      {2, 1, 2, 1, 64, 64, true, true, true},        // one-token runs
  };
  std::uint64_t seed = 100;
  for (const Shape& s : shapes) check_shape(s, seed += 10);
}

// Misaligned pointers (every input and output one element into its allocation) take the
// element-wise loads and stores at head dims that are otherwise vectorized.
TEST(LinearAttentionCuda, MisalignedPointersMatchCpu) {
  KEEL_REQUIRE_GPU();
  check_shape({2, 90, 4, 2, 64, 64, true, true, true}, 300, 1);
  check_shape({1, 70, 2, 2, 128, 32, false, false, true}, 310, 1);
}

// A longer run through many chunks (the scan's pipeline wraps around its stages many times).
TEST(LinearAttentionCuda, LongRunMatchesCpu) {
  KEEL_REQUIRE_GPU();
  check_shape({1, 1000, 2, 1, 64, 64, true, true, true}, 400);
  check_shape({1, 700, 2, 2, 128, 64, false, false, false}, 410);
}

// Runs of several scan segments (ops/cuda/linear_attention.h: at these sizes 4 chunks per
// segment): whole segments, a last segment of one or two chunks, a tail chunk, every head width,
// GQA, misaligned pointers; backward's dinit still init_gradient's bits (expect_match).
TEST(LinearAttentionCuda, SegmentedScanMatchesCpu) {
  KEEL_REQUIRE_GPU();
  const Shape shapes[] = {
      {1, 512, 4, 2, 128, 64, true, true, true},    // 2 segments of 4 chunks, GQA 2
      {2, 640, 2, 2, 64, 64, true, true, true},     // 3 segments, the last of 2 chunks, 2 runs
      {1, 320, 4, 1, 64, 64, false, true, true},    // a last segment of one chunk, GQA 4, no decay
      {1, 384, 2, 1, 16, 16, true, true, true},     // d 16
      {1, 448, 2, 2, 48, 64, true, true, false},    // d 48: element loads
      {1, 320, 3, 3, 5, 8, true, true, true},       // d 5 (state not a multiple of 4 floats)
      {1, 1030, 2, 2, 32, 64, true, false, true},   // 5 segments, the last one chunk of 6 tokens
  };
  std::uint64_t seed = 1000;
  for (const Shape& s : shapes) check_shape(s, seed += 10);
  check_shape({1, 512, 2, 2, 128, 64, true, true, true}, 1100, 1);  // misaligned
}

// A later token never reaches an earlier output: perturbing token p's k and v leaves every output
// row before p bit-identical (a diagonal tile left unmasked, or a state that already includes its
// chunk, would not), and changes row p.
TEST(LinearAttentionCuda, NoFutureTokenLeaks) {
  KEEL_REQUIRE_GPU();
  struct Case {
    int d;
    std::int64_t len;
    std::vector<std::int64_t> tokens;
  };
  const Case cases[] = {{128, 160, {0, 1, 7, 15, 16, 17, 31, 32, 63, 64, 65, 100, 127, 128, 159}},
                        {16, 160, {0, 1, 7, 15, 16, 17, 31, 32, 63, 64, 65, 100, 127, 128, 159}},
                        {64, 320, {0, 63, 64, 191, 192, 255, 256, 257, 300, 319}}};  // the segmented scan
  for (const Case& cs : cases) {
    const int d = cs.d;
    const Shape s{1, cs.len, 4, 2, d, 64, true, true, false};
    SCOPED_TRACE(describe(s));
    const la::Config cfg = config_of(s);
    const Inputs base = make(s, 500);
    Device g0(s, cfg, base);
    kla::forward(cfg, s.runs, s.len, g0.q.get(), g0.k.get(), g0.v.get(), g0.init.get(), g0.out.get(), g0.ws.get(),
                 nullptr);
    const std::vector<float> o0 = g0.host(g0.out);
    const std::int64_t row = std::int64_t(s.hq) * s.d, kw = std::int64_t(s.hkv) * s.d;
    for (const std::int64_t p : cs.tokens) {
      Inputs x = base;
      for (std::int64_t j = 0; j < kw; ++j) {
        x.k[p * kw + j] = test::bf16_round(x.k[p * kw + j] + 0.5f);
        x.v[p * kw + j] = test::bf16_round(x.v[p * kw + j] - 0.5f);
      }
      Device g(s, cfg, x);
      kla::forward(cfg, s.runs, s.len, g.q.get(), g.k.get(), g.v.get(), g.init.get(), g.out.get(), g.ws.get(),
                   nullptr);
      const std::vector<float> o1 = g.host(g.out);
      for (std::int64_t t = 0; t <= p; ++t) {
        bool same = true;
        for (std::int64_t j = 0; j < row; ++j) same &= o0[t * row + j] == o1[t * row + j];
        if (t < p) EXPECT_TRUE(same) << "token " << p << " leaked into output " << t;
        else EXPECT_FALSE(same) << "token " << p << " does not reach its own output";
      }
    }
  }
}

// Two backward passes on the same inputs agree bit for bit (no atomics anywhere).
TEST(LinearAttentionCuda, BackwardIsDeterministic) {
  KEEL_REQUIRE_GPU();
  const Shape s{2, 150, 8, 2, 128, 64, true, true, true};
  const la::Config cfg = config_of(s);
  const Inputs x = make(s, 600);
  Device a(s, cfg, x), b(s, cfg, x);
  const Results ra = run_gpu(s, cfg, a), rb = run_gpu(s, cfg, b);
  EXPECT_TRUE(all_close(ra.dq, rb.dq, 0.f, 0.f, "dq"));
  EXPECT_TRUE(all_close(ra.dk, rb.dk, 0.f, 0.f, "dk"));
  EXPECT_TRUE(all_close(ra.dv, rb.dv, 0.f, 0.f, "dv"));
  EXPECT_TRUE(all_close(ra.dinit, rb.dinit, 0.f, 0.f, "dinit"));
}

// Decode: one step from a random state against the CPU step (the state update rounds exactly as
// the CPU's), and stepping a batch token by token from zeros gives forward's rows.
TEST(LinearAttentionCuda, StepMatchesCpuAndForward) {
  KEEL_REQUIRE_GPU();
  for (const int d : {64, 128, 5}) {
    const Shape s{3, 9, 4, 2, d, 64, true, false, false};
    SCOPED_TRACE(describe(s));
    const la::Config cfg = config_of(s);
    const std::int64_t B = s.runs, qw = std::int64_t(s.hq) * d, kw = std::int64_t(s.hkv) * d, nst = B * s.hkv * d * d;

    // One step from a random state.
    std::vector<float> q = rounded_bf16(random_vector(B * qw, 700, -0.5f, 0.5f)),
                       k = rounded_bf16(random_vector(B * kw, 701, -0.5f, 0.5f)),
                       v = rounded_bf16(random_vector(B * kw, 702)), state = random_vector(nst, 703, -0.3f, 0.3f);
    std::vector<float> want_state = state, want_out(B * qw);
    la::step(cfg, Tensor(q.data(), {B, qw}), Tensor(k.data(), {B, kw}), Tensor(v.data(), {B, kw}),
             Tensor(want_state.data(), {B, s.hkv, d, d}), Tensor(want_out.data(), {B, qw}));
    auto d_q = to_device<cuda_bf16>(q), d_k = to_device<cuda_bf16>(k), d_v = to_device<cuda_bf16>(v);
    auto d_state = to_device<float>(state);
    DeviceArray<cuda_bf16> d_out(B * qw);
    kla::step(cfg, B, d_q.get(), d_k.get(), d_v.get(), d_state.get(), d_out.get(), nullptr);
    EXPECT_TRUE(all_close(download_f32(d_state.get(), nst), want_state, 1e-6f, 1e-7f, "state"));
    EXPECT_LT(logged_rel_err("step out", download_bf16(d_out.get(), B * qw), want_out), 1e-2);

    // Token by token from zeros against forward on the GPU.
    const Inputs x = make(s, 710);
    Device g(s, cfg, x);
    kla::forward(cfg, s.runs, s.len, g.q.get(), g.k.get(), g.v.get(), nullptr, g.out.get(), g.ws.get(), nullptr);
    const std::vector<float> full = g.host(g.out);
    KEEL_CUDA_CHECK(cudaMemset(d_state.get(), 0, nst * sizeof(float)));
    std::vector<float> got(full.size());
    for (std::int64_t t = 0; t < s.len; ++t) {
      std::vector<float> qt, kt, vt;
      for (std::int64_t b = 0; b < B; ++b) {
        qt.insert(qt.end(), x.q.begin() + (b * s.len + t) * qw, x.q.begin() + (b * s.len + t + 1) * qw);
        kt.insert(kt.end(), x.k.begin() + (b * s.len + t) * kw, x.k.begin() + (b * s.len + t + 1) * kw);
        vt.insert(vt.end(), x.v.begin() + (b * s.len + t) * kw, x.v.begin() + (b * s.len + t + 1) * kw);
      }
      auto dqt = to_device<cuda_bf16>(qt), dkt = to_device<cuda_bf16>(kt), dvt = to_device<cuda_bf16>(vt);
      kla::step(cfg, B, dqt.get(), dkt.get(), dvt.get(), d_state.get(), d_out.get(), nullptr);
      const std::vector<float> o = download_bf16(d_out.get(), B * qw);
      for (std::int64_t b = 0; b < B; ++b)
        std::copy(o.begin() + b * qw, o.begin() + (b + 1) * qw, got.begin() + (b * s.len + t) * qw);
    }
    EXPECT_LT(logged_rel_err("steps vs fwd", got, full), kTol);
  }
}

// The feature map and the per-head norm, forward and backward, against the CPU op on the same
// bf16 values (in place too: y over x, dx over dy).
TEST(LinearAttentionCuda, FeatureAndNormMatchCpu) {
  KEEL_REQUIRE_GPU();
  for (const std::int64_t d : {128, 5}) {
    const std::int64_t M = 37, n = M * d;
    SCOPED_TRACE("d " + std::to_string(d));
    const std::vector<float> x = rounded_bf16(random_vector(n, 800, -2.f, 2.f)),
                             dy = rounded_bf16(random_vector(n, 801));
    for (const la::Feature f : {la::Feature::kIdentity, la::Feature::kElu1}) {
      SCOPED_TRACE(la::feature_name(f));
      std::vector<float> xc = x, want(n);
      la::feature_forward(f, Tensor(xc.data(), {M, d}), Tensor(want.data(), {M, d}));
      auto d_x = to_device<cuda_bf16>(x);
      DeviceArray<cuda_bf16> d_y(n);
      kla::feature_forward(f, d_x.get(), d_y.get(), n, nullptr);
      const std::vector<float> y = download_bf16(d_y.get(), n);
      EXPECT_TRUE(all_close(y, want, 8e-3f, 1e-6f, "feature y"));
      kla::feature_forward(f, d_x.get(), d_x.get(), n, nullptr);  // in place
      EXPECT_TRUE(all_close(download_bf16(d_x.get(), n), y, 0.f, 0.f, "feature y in place"));

      std::vector<float> yc = y, dyc = dy, want_dx(n);
      la::feature_backward(f, Tensor(yc.data(), {M, d}), Tensor(dyc.data(), {M, d}), Tensor(want_dx.data(), {M, d}));
      auto d_dy = to_device<cuda_bf16>(dy);
      DeviceArray<cuda_bf16> d_dx(n);
      kla::feature_backward(f, d_y.get(), d_dy.get(), d_dx.get(), n, nullptr);
      const std::vector<float> dx = download_bf16(d_dx.get(), n);
      EXPECT_TRUE(all_close(dx, want_dx, 8e-3f, 1e-6f, "feature dx"));
      kla::feature_backward(f, d_y.get(), d_dy.get(), d_dy.get(), n, nullptr);  // in place
      EXPECT_TRUE(all_close(download_bf16(d_dy.get(), n), dx, 0.f, 0.f, "feature dx in place"));
    }

    // Norm forward: y and rstd; backward from the GPU's y and rstd.
    std::vector<float> xc = x, want_y(n), want_rstd(M);
    la::norm_forward(Tensor(xc.data(), {M, d}), 1e-5f, Tensor(want_y.data(), {M, d}), Tensor(want_rstd.data(), {M}));
    auto d_x = to_device<cuda_bf16>(x);
    DeviceArray<cuda_bf16> d_y(n);
    DeviceArray<float> d_rstd(M);
    kla::norm_forward(d_x.get(), M, int(d), 1e-5f, d_y.get(), d_rstd.get(), nullptr);
    const std::vector<float> y = download_bf16(d_y.get(), n), rstd = download_f32(d_rstd.get(), M);
    EXPECT_TRUE(all_close(rstd, want_rstd, 1e-5f, 0.f, "norm rstd"));
    EXPECT_LT(logged_rel_err("norm y", y, want_y), 1e-2);
    kla::norm_forward(d_x.get(), M, int(d), 1e-5f, d_x.get(), d_rstd.get(), nullptr);  // in place
    EXPECT_TRUE(all_close(download_bf16(d_x.get(), n), y, 0.f, 0.f, "norm y in place"));

    std::vector<float> yc = y, rc = rstd, dyc = dy, want_dx(n);
    la::norm_backward(Tensor(yc.data(), {M, d}), Tensor(rc.data(), {M}), Tensor(dyc.data(), {M, d}),
                      Tensor(want_dx.data(), {M, d}));
    auto d_dy = to_device<cuda_bf16>(dy);
    DeviceArray<cuda_bf16> d_dx(n);
    kla::norm_backward(d_y.get(), d_rstd.get(), d_dy.get(), d_dx.get(), M, int(d), nullptr);
    const std::vector<float> dx = download_bf16(d_dx.get(), n);
    EXPECT_LT(logged_rel_err("norm dx", dx, want_dx), 1e-2);
    kla::norm_backward(d_y.get(), d_rstd.get(), d_dy.get(), d_dy.get(), M, int(d), nullptr);  // in place
    EXPECT_TRUE(all_close(download_bf16(d_dy.get(), n), dx, 0.f, 0.f, "norm dx in place"));
  }
}

// Unsupported configurations throw keel::Error before anything is launched.
TEST(LinearAttentionCuda, RejectsBadConfigs) {
  KEEL_REQUIRE_GPU();
  la::Config c;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 64;
  EXPECT_NO_THROW(kla::workspace_bytes(c, 2, 100));
  la::Config wide = c;
  wide.head_dim = 256;
  EXPECT_THROW(kla::workspace_bytes(wide, 2, 100), Error);
  la::Config many = c;
  many.heads = many.kv_heads = kla::kMaxKvHeads + 1;
  EXPECT_THROW(kla::workspace_bytes(many, 1, 100), Error);
  la::Config uneven = c;
  uneven.heads = 3;
  EXPECT_THROW(kla::workspace_bytes(uneven, 1, 100), Error);
  la::Config negative = c;
  negative.decay = {0.9f, -0.5f};
  EXPECT_THROW(kla::workspace_bytes(negative, 1, 100), Error);
  la::Config short_decay = c;
  short_decay.decay = {0.9f};
  EXPECT_THROW(kla::workspace_bytes(short_decay, 1, 100), Error);
  la::Config zero_chunk = c;
  zero_chunk.chunk = 0;
  EXPECT_THROW(kla::workspace_bytes(zero_chunk, 1, 100), Error);

  // A workspace that is not 256-byte aligned.
  const Shape s{1, 10, 4, 2, 64, 64, false, false, false};
  const Inputs x = make(s, 900);
  Device g(s, c, x);
  DeviceArray<unsigned char> ws(kla::workspace_bytes(c, 1, 10) + 256);
  EXPECT_THROW(kla::forward(c, 1, 10, g.q.get(), g.k.get(), g.v.get(), nullptr, g.out.get(), ws.get() + 16, nullptr),
               Error);
}

}  // namespace
}  // namespace keel

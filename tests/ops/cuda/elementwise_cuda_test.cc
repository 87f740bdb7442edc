// The elementwise / normalization CUDA ops against their CPU references (src/ops) on fresh
// random inputs: embedding, rmsnorm, rope, swiglu. Shapes include odd
// sizes and tails that are not a multiple of the vector width, and misaligned pointers, so both
// the vector and the element-wise paths run.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cuda/embedding.h"
#include "ops/cuda/rmsnorm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/swiglu.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

namespace keel {
namespace {

using cuda_bf16 = __nv_bfloat16;
using test::all_close;
using test::DeviceArray;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
using test::to_host;
using test::upload_raw;

std::vector<std::uint32_t> random_ids(std::int64_t n, std::int64_t vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint32_t> u(0, static_cast<std::uint32_t>(vocab - 1));
  std::vector<std::uint32_t> ids(n);
  for (auto& id : ids) id = u(rng);
  return ids;
}

// A bf16 view of device data starting `offset` elements in (offset 1: not vector-aligned).
std::vector<float> slice(const std::vector<float>& v, std::size_t offset) { return {v.begin() + offset, v.end()}; }

// ---------------------------------------------------------------- embedding

struct EmbShape {
  std::int64_t vocab, dim, n;
};

TEST(ElementwiseCudaEmbedding, ForwardAndBackwardMatchCpu) {
  KEEL_REQUIRE_GPU();
  for (const EmbShape s : {EmbShape{50, 96, 37}, EmbShape{1000, 2048, 64}, EmbShape{13, 7, 37}, EmbShape{5, 6, 300}}) {
    SCOPED_TRACE(testing::Message() << "V " << s.vocab << " D " << s.dim << " n " << s.n);
    auto table = random_vector(s.vocab * s.dim, 1);
    auto ids = random_ids(s.n, s.vocab, 2);  // repeats are likely: backward must add them up
    auto d_ids = upload_raw(ids);
    auto d_table = to_device<float>(table);
    DeviceArray<float> d_out(s.n * s.dim);
    ops::cuda::embedding::forward(d_ids.get(), s.n, d_table.get(), d_out.get(), s.vocab, s.dim, nullptr);
    std::vector<float> want(s.n * s.dim);
    ops::embedding::forward(ids.data(), s.n, Tensor(table.data(), {s.vocab, s.dim}), Tensor(want.data(), {s.n, s.dim}));
    EXPECT_TRUE(all_close(to_host(d_out), want, 0.f, 0.f, "forward (a copy: exact)"));

    // bf16 table variant: the exact float of each bf16 entry.
    auto table_r = rounded_bf16(table);
    auto d_table_bf16 = to_device<cuda_bf16>(table);
    ops::cuda::embedding::forward_bf16_table(d_ids.get(), s.n, d_table_bf16.get(), d_out.get(), s.vocab, s.dim,
                                             nullptr);
    ops::embedding::forward(ids.data(), s.n, Tensor(table_r.data(), {s.vocab, s.dim}), Tensor(want.data(), {s.n, s.dim}));
    EXPECT_TRUE(all_close(to_host(d_out), want, 0.f, 0.f, "forward bf16 table"));

    // Backward accumulates into a non-zero dtable.
    auto dout = random_vector(s.n * s.dim, 3);
    auto dtable = random_vector(s.vocab * s.dim, 4);
    auto d_dout = to_device<float>(dout);
    auto d_dtable = to_device<float>(dtable);
    ops::cuda::embedding::backward(d_ids.get(), s.n, d_dout.get(), d_dtable.get(), s.vocab, s.dim, nullptr);
    ops::embedding::backward(ids.data(), s.n, Tensor(dout.data(), {s.n, s.dim}), Tensor(dtable.data(), {s.vocab, s.dim}));
    EXPECT_TRUE(all_close(to_host(d_dtable), dtable, 1e-5f, 1e-5f, "backward dtable"));
  }
}

TEST(ElementwiseCudaEmbedding, BadIdIsRecordedNotRead) {
  KEEL_REQUIRE_GPU();
  const std::int64_t vocab = 11, dim = 8, n = 20;
  auto table = random_vector(vocab * dim, 5);
  auto ids = random_ids(n, vocab, 6);
  ids[9] = vocab + 1000;  // recorded only as the second bad one
  ids[5] = vocab;         // the first bad position
  auto d_ids = upload_raw(ids);
  auto d_table = to_device<float>(table);
  DeviceArray<float> d_out(n * dim);
  DeviceArray<unsigned long long> d_bad(1);
  ops::cuda::embedding::reset_bad_id(d_bad.get(), nullptr);
  ops::cuda::embedding::forward(d_ids.get(), n, d_table.get(), d_out.get(), vocab, dim, nullptr, d_bad.get());
  auto out = to_host(d_out);
  for (std::int64_t j = 0; j < dim; ++j) {
    EXPECT_EQ(out[5 * dim + j], 0.f);
    EXPECT_EQ(out[9 * dim + j], 0.f);
    EXPECT_EQ(out[0 * dim + j], table[ids[0] * dim + j]);
  }
  try {
    ops::cuda::embedding::throw_if_bad_id(d_bad.get(), vocab, nullptr);
    ADD_FAILURE() << "no error for an out-of-range id";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 11 at position 5"), std::string::npos) << e.what();
  }
  // Backward skips the bad tokens (and records them again); the good ones still add up.
  ops::cuda::embedding::reset_bad_id(d_bad.get(), nullptr);
  auto dout = random_vector(n * dim, 7);
  auto d_dout = to_device<float>(dout);
  DeviceArray<float> d_dtable(vocab * dim);
  ops::cuda::embedding::backward(d_ids.get(), n, d_dout.get(), d_dtable.get(), vocab, dim, nullptr, d_bad.get());
  EXPECT_THROW(ops::cuda::embedding::throw_if_bad_id(d_bad.get(), vocab, nullptr), Error);
  std::vector<float> want(vocab * dim, 0.f);
  for (std::int64_t i = 0; i < n; ++i)
    if (ids[i] < vocab)
      for (std::int64_t j = 0; j < dim; ++j) want[ids[i] * dim + j] += dout[i * dim + j];
  EXPECT_TRUE(all_close(to_host(d_dtable), want, 1e-5f, 1e-5f, "backward without the bad ids"));
  // A clean record does not throw.
  ops::cuda::embedding::reset_bad_id(d_bad.get(), nullptr);
  EXPECT_NO_THROW(ops::cuda::embedding::throw_if_bad_id(d_bad.get(), vocab, nullptr));
}

// Vocabulary slices (tensor parallelism) simulated in one process: rank r of T holds rows
// [b_r, b_{r+1}) of the table. The partial lookups are the whole lookup's rows in the slice and
// zeros elsewhere, so their sum over the ranks is the whole lookup exactly; the slice backward
// adds into its own rows only (given a pointer into a whole-table buffer, every row outside the
// slice stays as it was) and the union of the slices is the whole-table backward.
struct EmbSliceCase {
  std::int64_t vocab, dim, n;
  int ranks;
  std::vector<std::int64_t> sizes;  // empty: r V / T
};

TEST(ElementwiseCudaEmbedding, VocabSlicesMatchWholeTable) {
  KEEL_REQUIRE_GPU();
  // Odd widths (element path), uneven and empty slices, begins that are no multiple of 8.
  const EmbSliceCase cases[] = {{1000, 96, 64, 1, {}},   {1000, 96, 64, 2, {}}, {1000, 96, 300, 3, {334, 333, 333}},
                                {1000, 2048, 64, 4, {}}, {13, 7, 37, 3, {}},    {13, 8, 37, 4, {0, 5, 5, 3}}};
  std::uint64_t seed = 500;
  for (const EmbSliceCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "V " << c.vocab << " D " << c.dim << " n " << c.n << " T " << c.ranks
                                    << (c.sizes.empty() ? "" : " uneven"));
    const std::int64_t v = c.vocab, dim = c.dim, n = c.n;
    std::vector<std::int64_t> b(c.ranks + 1, 0);
    for (int r = 1; r <= c.ranks; ++r) b[r] = c.sizes.empty() ? r * v / c.ranks : b[r - 1] + c.sizes[r - 1];
    ASSERT_EQ(b.back(), v);
    auto table = rounded_bf16(random_vector(v * dim, ++seed));
    const auto ids = random_ids(n, v, ++seed);
    auto d_ids = upload_raw(ids);
    auto d_table = to_device<cuda_bf16>(table);
    std::vector<float> whole(n * dim);
    ops::embedding::forward(ids.data(), n, Tensor(table.data(), {v, dim}), Tensor(whole.data(), {n, dim}));

    // Forward: each partial exactly, then their sum.
    std::vector<float> sum(n * dim, 0.f);
    for (int r = 0; r < c.ranks; ++r) {
      auto d_out = to_device<float>(random_vector(n * dim, 600 + r));  // poisoned: every row is written
      ops::cuda::embedding::forward_bf16_table_slice(d_ids.get(), n, d_table.get() + b[r] * dim, d_out.get(), b[r],
                                                     b[r + 1] - b[r], v, dim, nullptr);
      const auto out = to_host(d_out);
      std::vector<float> want(n * dim, 0.f);
      for (std::int64_t i = 0; i < n; ++i)
        if (ids[i] >= b[r] && ids[i] < b[r + 1])
          for (std::int64_t j = 0; j < dim; ++j) want[i * dim + j] = whole[i * dim + j];
      EXPECT_TRUE(all_close(out, want, 0.f, 0.f, "rank " + std::to_string(r) + "'s partial lookup"));
      for (std::int64_t k = 0; k < n * dim; ++k) sum[k] += out[k];
    }
    EXPECT_TRUE(all_close(sum, whole, 0.f, 0.f, "partials summed over the ranks"));

    // Backward: own rows only, the union the whole-table backward.
    const auto dout = random_vector(n * dim, ++seed);
    const auto dtable0 = random_vector(v * dim, ++seed);
    std::vector<float> want = dtable0, dout_h = dout;
    ops::embedding::backward(ids.data(), n, Tensor(dout_h.data(), {n, dim}), Tensor(want.data(), {v, dim}));
    auto d_dout = to_device<float>(dout);
    std::vector<float> uni(v * dim);
    for (int r = 0; r < c.ranks; ++r) {
      auto d_dtable = to_device<float>(dtable0);
      ops::cuda::embedding::backward_slice(d_ids.get(), n, d_dout.get(), d_dtable.get() + b[r] * dim, b[r],
                                           b[r + 1] - b[r], v, dim, nullptr);
      const auto got = to_host(d_dtable);
      for (std::int64_t row = 0; row < v; ++row) {
        const bool own = row >= b[r] && row < b[r + 1];
        for (std::int64_t j = 0; j < dim; ++j) {
          const std::int64_t k = row * dim + j;
          if (own)
            uni[k] = got[k];
          else
            ASSERT_EQ(got[k], dtable0[k]) << "rank " << r << " wrote row " << row << ", outside its slice";
        }
      }
    }
    EXPECT_TRUE(all_close(uni, want, 1e-5f, 1e-5f, "slice backwards together"));
  }
}

TEST(ElementwiseCudaEmbedding, VocabSliceBadIdIsRecordedAndSliceChecked) {
  KEEL_REQUIRE_GPU();
  const std::int64_t vocab = 11, dim = 8, n = 20, begin = 4, rows = 4;
  const auto table = rounded_bf16(random_vector(vocab * dim, 8));
  auto ids = random_ids(n, vocab, 9);
  ids[7] = vocab + 3;
  ids[12] = vocab;
  auto d_ids = upload_raw(ids);
  auto d_table = to_device<cuda_bf16>(table);
  DeviceArray<float> d_out(n * dim);
  DeviceArray<unsigned long long> d_bad(1);
  ops::cuda::embedding::reset_bad_id(d_bad.get(), nullptr);
  ops::cuda::embedding::forward_bf16_table_slice(d_ids.get(), n, d_table.get() + begin * dim, d_out.get(), begin, rows,
                                                 vocab, dim, nullptr, d_bad.get());
  const auto out = to_host(d_out);
  for (std::int64_t j = 0; j < dim; ++j) {
    EXPECT_EQ(out[7 * dim + j], 0.f);
    EXPECT_EQ(out[12 * dim + j], 0.f);
  }
  try {
    ops::cuda::embedding::throw_if_bad_id(d_bad.get(), vocab, nullptr);
    ADD_FAILURE() << "no error for an out-of-range id";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 14 at position 7"), std::string::npos) << e.what();
  }
  ops::cuda::embedding::reset_bad_id(d_bad.get(), nullptr);
  auto d_dout = to_device<float>(random_vector(n * dim, 10));
  DeviceArray<float> d_dtable(rows * dim);
  ops::cuda::embedding::backward_slice(d_ids.get(), n, d_dout.get(), d_dtable.get(), begin, rows, vocab, dim, nullptr,
                                       d_bad.get());
  EXPECT_THROW(ops::cuda::embedding::throw_if_bad_id(d_bad.get(), vocab, nullptr), Error);
  // A slice outside the vocabulary is refused.
  EXPECT_THROW(ops::cuda::embedding::forward_bf16_table_slice(d_ids.get(), n, d_table.get(), d_out.get(), 8, 4, vocab,
                                                              dim, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::embedding::backward_slice(d_ids.get(), n, d_dout.get(), d_dtable.get(), -1, 4, vocab, dim,
                                                    nullptr),
               Error);
}

// ---------------------------------------------------------------- rmsnorm

struct NormShape {
  std::int64_t rows, dim;
};

TEST(ElementwiseCudaRmsNorm, ForwardAndBackwardMatchCpu) {
  KEEL_REQUIRE_GPU();
  const float eps = 1e-5f;
  for (const NormShape s : {NormShape{37, 96}, NormShape{37, 2048}, NormShape{5, 7}, NormShape{37, 2050},
                            NormShape{3, 4100}, NormShape{1000, 96}}) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " dim " << s.dim);
    const std::int64_t rows = s.rows, dim = s.dim;
    auto x = random_vector(rows * dim, 10);
    auto w = random_vector(dim, 11, 0.5f, 1.5f);
    std::vector<float> y(rows * dim), rstd(rows);
    ops::rmsnorm::forward(Tensor(x.data(), {rows, dim}), Tensor(w.data(), {dim}), eps, Tensor(y.data(), {rows, dim}),
                          Tensor(rstd.data(), {rows}));

    auto d_x = to_device<float>(x);
    auto d_w = to_device<float>(w);
    DeviceArray<cuda_bf16> d_y(rows * dim);
    DeviceArray<float> d_rstd(rows);
    ops::cuda::rmsnorm::forward(d_x.get(), d_w.get(), eps, d_y.get(), d_rstd.get(), rows, dim, nullptr);
    EXPECT_TRUE(all_close(to_host(d_rstd), rstd, 1e-5f, 0.f, "rstd"));
    EXPECT_TRUE(all_close(to_host(d_y), y, 1e-2f, 1e-3f, "y (bf16)"));

    // Backward from the CPU's saved rstd (isolates backward). dx and dw start non-zero: both
    // ops accumulate into both (docs/ops.md, Gradient convention).
    auto dy = rounded_bf16(random_vector(rows * dim, 12));
    auto dx0 = random_vector(rows * dim, 13);
    auto dw = random_vector(dim, 14);
    auto d_dy = to_device<cuda_bf16>(dy);
    auto d_rstd_cpu = to_device<float>(rstd);
    auto d_dx = to_device<float>(dx0);
    auto d_dw = to_device<float>(dw);
    ops::cuda::rmsnorm::backward(d_x.get(), d_w.get(), d_rstd_cpu.get(), d_dy.get(), d_dx.get(), d_dw.get(), rows, dim,
                                 nullptr);
    std::vector<float> dx = dx0;
    ops::rmsnorm::backward(Tensor(x.data(), {rows, dim}), Tensor(w.data(), {dim}), Tensor(rstd.data(), {rows}),
                           Tensor(dy.data(), {rows, dim}), Tensor(dx.data(), {rows, dim}), Tensor(dw.data(), {dim}));
    EXPECT_TRUE(all_close(to_host(d_dx), dx, 1e-5f, 1e-5f, "dx (accumulated)"));
    EXPECT_TRUE(all_close(to_host(d_dw), dw, 1e-5f, 1e-4f, "dw (accumulated)"));
  }
}

TEST(ElementwiseCudaRmsNorm, NullOutputsAreSkipped) {
  KEEL_REQUIRE_GPU();
  const std::int64_t rows = 9, dim = 64;
  auto x = random_vector(rows * dim, 20), w = random_vector(dim, 21);
  auto dy = rounded_bf16(random_vector(rows * dim, 22));
  const auto dx0 = random_vector(rows * dim, 23);  // both sides add into the same non-zero start
  std::vector<float> y(rows * dim), rstd(rows), dx = dx0, dw(dim, 0.f);
  ops::rmsnorm::forward(Tensor(x.data(), {rows, dim}), Tensor(w.data(), {dim}), 1e-6f, Tensor(y.data(), {rows, dim}),
                        Tensor(rstd.data(), {rows}));
  ops::rmsnorm::backward(Tensor(x.data(), {rows, dim}), Tensor(w.data(), {dim}), Tensor(rstd.data(), {rows}),
                         Tensor(dy.data(), {rows, dim}), Tensor(dx.data(), {rows, dim}), Tensor(dw.data(), {dim}));
  auto d_x = to_device<float>(x), d_w = to_device<float>(w), d_rstd = to_device<float>(rstd);
  auto d_dy = to_device<cuda_bf16>(dy);
  DeviceArray<cuda_bf16> d_y(rows * dim);
  ops::cuda::rmsnorm::forward(d_x.get(), d_w.get(), 1e-6f, d_y.get(), nullptr, rows, dim, nullptr);
  EXPECT_TRUE(all_close(to_host(d_y), y, 1e-2f, 1e-3f, "y without rstd"));
  auto d_dx = to_device<float>(dx0);
  DeviceArray<float> d_dw(dim);
  ops::cuda::rmsnorm::backward(d_x.get(), d_w.get(), d_rstd.get(), d_dy.get(), d_dx.get(), nullptr, rows, dim, nullptr);
  ops::cuda::rmsnorm::backward(d_x.get(), d_w.get(), d_rstd.get(), d_dy.get(), nullptr, d_dw.get(), rows, dim, nullptr);
  EXPECT_TRUE(all_close(to_host(d_dx), dx, 1e-5f, 1e-5f, "dx only"));
  EXPECT_TRUE(all_close(to_host(d_dw), dw, 1e-5f, 1e-5f, "dw only"));
  EXPECT_THROW(ops::cuda::rmsnorm::forward(d_x.get(), d_w.get(), 1e-6f, d_y.get(), nullptr, rows, 0, nullptr), Error);
}

// ---------------------------------------------------------------- rope

struct RopeShape {
  std::int64_t n, heads;
  int head_dim;
  double fraction;
};

TEST(ElementwiseCudaRope, ForwardAndBackwardMatchCpu) {
  KEEL_REQUIRE_GPU();
  const int max_pos = 64;
  for (const RopeShape s : {RopeShape{37, 3, 16, 1.0}, RopeShape{37, 4, 128, 0.5}, RopeShape{5, 2, 10, 0.6},
                            RopeShape{37, 1, 7, 4.0 / 7.0}}) {
    SCOPED_TRACE(testing::Message() << "n " << s.n << " heads " << s.heads << " head_dim " << s.head_dim);
    const auto table = ops::rope::make_table(s.head_dim, s.fraction, 10000.0, max_pos);
    ops::cuda::rope::UploadedTable d_table(table);
    std::vector<std::int32_t> pos(s.n);
    std::mt19937 rng(30);
    for (auto& p : pos) p = static_cast<std::int32_t>(rng() % max_pos);
    auto d_pos = upload_raw(pos);
    const std::int64_t total = s.n * s.heads * s.head_dim;

    auto x = rounded_bf16(random_vector(total, 31));
    auto d_x = to_device<cuda_bf16>(x);
    ops::cuda::rope::forward(d_table.view(), d_x.get(), d_pos.get(), s.n, s.heads, nullptr);
    std::vector<float> y(total);
    ops::rope::forward(table, Tensor(x.data(), {s.n, s.heads, s.head_dim}), pos.data(),
                       Tensor(y.data(), {s.n, s.heads, s.head_dim}));
    const auto got = to_host(d_x);
    EXPECT_TRUE(all_close(got, y, 1e-2f, 1e-3f, "forward"));
    // Unfused fp32 math: exactly the CPU value rounded once to bf16.
    EXPECT_TRUE(all_close(got, rounded_bf16(y), 0.f, 0.f, "forward, bit-exact after bf16 rounding"));

    auto dy = rounded_bf16(random_vector(total, 32));
    auto d_g = to_device<cuda_bf16>(dy);
    ops::cuda::rope::backward(d_table.view(), d_g.get(), d_pos.get(), s.n, s.heads, nullptr);
    std::vector<float> dx(total);
    ops::rope::backward(table, Tensor(dy.data(), {s.n, s.heads, s.head_dim}), pos.data(),
                        Tensor(dx.data(), {s.n, s.heads, s.head_dim}));
    const auto got_dx = to_host(d_g);
    EXPECT_TRUE(all_close(got_dx, dx, 1e-2f, 1e-3f, "backward"));
    EXPECT_TRUE(all_close(got_dx, rounded_bf16(dx), 0.f, 0.f, "backward, bit-exact after bf16 rounding"));
  }
}

// ---------------------------------------------------------------- swiglu

TEST(ElementwiseCudaSwiGlu, ForwardAndBackwardMatchCpu) {
  KEEL_REQUIRE_GPU();
  // (n, offset): offset 1 puts every pointer off the 16-byte vector alignment.
  const std::vector<std::pair<std::int64_t, std::size_t>> cases = {
      {37 * 96, 0}, {37 * 2048 + 3, 0}, {7, 0}, {37 * 96 + 5, 1}, {1, 0}};
  for (const auto& [n, off] : cases) {
    SCOPED_TRACE(testing::Message() << "n " << n << " offset " << off);
    auto gate = rounded_bf16(random_vector(n + off, 40, -4.f, 4.f));
    auto up = rounded_bf16(random_vector(n + off, 41));
    auto dout = rounded_bf16(random_vector(n + off, 42));
    auto d_gate = to_device<cuda_bf16>(gate), d_up = to_device<cuda_bf16>(up), d_dout = to_device<cuda_bf16>(dout);
    DeviceArray<cuda_bf16> d_out(n + off), d_dgate(n + off), d_dup(n + off);
    ops::cuda::swiglu::forward(d_gate.get() + off, d_up.get() + off, d_out.get() + off, n, nullptr);
    ops::cuda::swiglu::backward(d_gate.get() + off, d_up.get() + off, d_dout.get() + off, d_dgate.get() + off,
                                d_dup.get() + off, n, nullptr);
    std::vector<float> out(n), dgate(n), dup(n);
    ops::swiglu::forward_n(gate.data() + off, up.data() + off, out.data(), n);
    ops::swiglu::backward_n(gate.data() + off, up.data() + off, dout.data() + off, dgate.data(), dup.data(), n);
    EXPECT_TRUE(all_close(slice(to_host(d_out), off), out, 1e-2f, 1e-3f, "out"));
    EXPECT_TRUE(all_close(slice(to_host(d_dgate), off), dgate, 1e-2f, 1e-3f, "dgate"));
    EXPECT_TRUE(all_close(slice(to_host(d_dup), off), dup, 1e-2f, 1e-3f, "dup"));

    // Only dup requested: dgate must not be touched.
    DeviceArray<cuda_bf16> d_dup2(n + off), d_dgate2(n + off);
    ops::cuda::swiglu::backward(d_gate.get() + off, d_up.get() + off, d_dout.get() + off, nullptr, d_dup2.get() + off,
                                n, nullptr);
    EXPECT_TRUE(all_close(slice(to_host(d_dup2), off), dup, 1e-2f, 1e-3f, "dup alone"));
    EXPECT_TRUE(all_close(to_host(d_dgate2), std::vector<float>(n + off, 0.f), 0.f, 0.f, "untouched dgate"));
  }
}

TEST(ElementwiseCudaSwiGlu, BackwardInPlaceOverInputs) {
  KEEL_REQUIRE_GPU();
  const std::int64_t n = 37 * 96 + 3;
  auto gate = rounded_bf16(random_vector(n, 43, -4.f, 4.f));
  auto up = rounded_bf16(random_vector(n, 44));
  auto dout = rounded_bf16(random_vector(n, 45));
  std::vector<float> dgate(n), dup(n);
  ops::swiglu::backward_n(gate.data(), up.data(), dout.data(), dgate.data(), dup.data(), n);
  auto d_gate = to_device<cuda_bf16>(gate), d_up = to_device<cuda_bf16>(up), d_dout = to_device<cuda_bf16>(dout);
  ops::cuda::swiglu::backward(d_gate.get(), d_up.get(), d_dout.get(), d_gate.get(), d_up.get(), n, nullptr);
  EXPECT_TRUE(all_close(to_host(d_gate), dgate, 1e-2f, 1e-3f, "dgate over gate"));
  EXPECT_TRUE(all_close(to_host(d_up), dup, 1e-2f, 1e-3f, "dup over up"));
}

}  // namespace
}  // namespace keel

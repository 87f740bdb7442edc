// ops/cuda/decode_attention.h against a CPU reference (double precision on the same bf16
// inputs): one query per sequence over the first `length` rows of a k/v cache, for GQA, MHA and
// groups wider than one block's 8 heads, head_dim 64 and 128, one key and full caches, lengths
// that take the split (flash-decoding) path, and sliding windows (the last W rows only). Cache
// rows past `length`, and before a window, hold NaN, so a read outside the keys shows up in the
// output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cuda/decode_attention.h"

namespace keel {
namespace {

using test::all_close;
using test::DeviceArray;
using test::norm_rel_err;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
using test::to_host;

// q [B, Hq, Dh], caches [B, cap, Hkv, Dh] rows first..len-1 -> out [B, Hq, Dh].
std::vector<float> reference(const std::vector<float>& q, const std::vector<float>& kc, const std::vector<float>& vc,
                             int B, int Hq, int Hkv, int Dh, std::int64_t cap, std::int64_t first, std::int64_t len,
                             double scale) {
  std::vector<float> out(static_cast<std::size_t>(B) * Hq * Dh);
  const int G = Hq / Hkv;
  std::vector<double> s(static_cast<std::size_t>(len));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h) {
      const int g = h / G;
      const float* qi = q.data() + (static_cast<std::int64_t>(b) * Hq + h) * Dh;
      double mx = -1e300;
      for (std::int64_t j = first; j < len; ++j) {
        const float* kj = kc.data() + ((b * cap + j) * Hkv + g) * Dh;
        double d = 0;
        for (int c = 0; c < Dh; ++c) d += double(qi[c]) * kj[c];
        s[j] = scale * d;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (std::int64_t j = first; j < len; ++j) sum += (s[j] = std::exp(s[j] - mx));
      for (int c = 0; c < Dh; ++c) {
        double o = 0;
        for (std::int64_t j = first; j < len; ++j) o += s[j] * vc[((b * cap + j) * Hkv + g) * Dh + c];
        out[(static_cast<std::int64_t>(b) * Hq + h) * Dh + c] = static_cast<float>(o / sum);
      }
    }
  return out;
}

// window: 0 = every cached row, W > 0 = the last W.
void check(int B, int Hq, int Hkv, int Dh, std::int64_t cap, std::int64_t len, std::uint64_t seed, int window = 0) {
  SCOPED_TRACE(testing::Message() << "B " << B << " Hq " << Hq << " Hkv " << Hkv << " Dh " << Dh << " cap " << cap
                                  << " len " << len << " window " << window);
  const std::int64_t first = window > 0 ? std::max<std::int64_t>(0, len - window) : 0;
  const std::size_t nq = static_cast<std::size_t>(B) * Hq * Dh, nc = static_cast<std::size_t>(B) * cap * Hkv * Dh;
  // Scores of a few units: the softmax is neither flat nor one-hot.
  const auto q = rounded_bf16(random_vector(nq, seed, -1.5f, 1.5f));
  auto kc = rounded_bf16(random_vector(nc, seed + 1, -1.5f, 1.5f));
  auto vc = rounded_bf16(random_vector(nc, seed + 2));
  for (int b = 0; b < B; ++b)
    for (std::int64_t j = 0; j < cap; ++j) {
      if (j >= first && j < len) continue;
      for (std::int64_t i = 0; i < Hkv * Dh; ++i) {
        kc[(b * cap + j) * Hkv * Dh + i] = std::numeric_limits<float>::quiet_NaN();
        vc[(b * cap + j) * Hkv * Dh + i] = std::numeric_limits<float>::quiet_NaN();
      }
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
  auto dq = to_device<__nv_bfloat16>(q);
  auto dk = to_device<__nv_bfloat16>(kc);
  auto dv = to_device<__nv_bfloat16>(vc);
  DeviceArray<__nv_bfloat16> dout(nq);
  DeviceArray<std::uint8_t> ws(ops::cuda::decode_attention::workspace_bytes(B, Hq, Dh));
  ops::cuda::decode_attention::forward(dq.get(), dk.get(), dv.get(), dout.get(), B, Hq, Hkv, Dh, cap, len, scale,
                                       window, ws.get(), nullptr);
  const auto got = to_host(dout);
  const auto want = reference(q, kc, vc, B, Hq, Hkv, Dh, cap, first, len, scale);
  const double e = norm_rel_err(got, want);
  std::printf("    splits %d: norm-relative error %.2e\n",
              ops::cuda::decode_attention::key_splits(B, Hq, Hkv, len - first), e);
  // The output is rounded once to bf16 (relative 2^-9); everything before is fp32.
  EXPECT_LT(e, 4e-3);
  EXPECT_TRUE(all_close(got, want, 1e-2f, 2e-3f, "out"));
}

TEST(DecodeAttentionCuda, GqaHeadDim64) {
  KEEL_REQUIRE_GPU();
  check(3, 8, 2, 64, 40, 1, 1);
  check(3, 8, 2, 64, 40, 17, 2);
  check(3, 8, 2, 64, 40, 40, 3);
}

TEST(DecodeAttentionCuda, MhaHeadDim128) {
  KEEL_REQUIRE_GPU();
  check(2, 4, 4, 128, 70, 1, 4);
  check(2, 4, 4, 128, 70, 69, 5);
}

// 16 query heads per kv head: two blocks of 8 heads each per group.
TEST(DecodeAttentionCuda, WideGroups) {
  KEEL_REQUIRE_GPU();
  check(2, 32, 2, 64, 50, 33, 6);
  check(1, 12, 1, 128, 20, 20, 7);  // 12 = 8 + 4: a partial second block
}

// Few blocks and long caches: the key range splits (partials merged by a second kernel).
TEST(DecodeAttentionCuda, SplitKeys) {
  KEEL_REQUIRE_GPU();
  EXPECT_GT(ops::cuda::decode_attention::key_splits(1, 8, 2, 3000), 1);
  EXPECT_EQ(ops::cuda::decode_attention::key_splits(200, 8, 2, 3000), 1);
  check(1, 8, 2, 64, 3000, 2999, 8);
  check(2, 16, 4, 128, 1000, 777, 9);
  check(1, 4, 2, 64, 200, 65, 10);  // two splits of 33 and 32 keys
}

// A sliding layer: the last W cached rows (rows before them are NaN), one key, a window inside
// one split or across several, and windows covering the whole cache.
TEST(DecodeAttentionCuda, SlidingWindow) {
  KEEL_REQUIRE_GPU();
  check(3, 8, 2, 64, 40, 17, 11, 1);
  check(3, 8, 2, 64, 40, 17, 12, 5);
  check(2, 4, 4, 128, 70, 69, 13, 17);
  check(2, 4, 4, 128, 70, 10, 14, 17);  // window longer than the cache so far: every row
  check(1, 8, 2, 64, 3000, 2999, 15, 1000);  // split keys within the window
  check(1, 12, 1, 128, 20, 20, 16, 20);
}

TEST(DecodeAttentionCuda, RejectsBadExtents) {
  KEEL_REQUIRE_GPU();
  DeviceArray<__nv_bfloat16> x(64 * 8 * 4);
  EXPECT_THROW(ops::cuda::decode_attention::forward(x.get(), x.get(), x.get(), x.get(), 1, 4, 2, 32, 8, 1, 1.f, 0,
                                                     nullptr, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::decode_attention::forward(x.get(), x.get(), x.get(), x.get(), 1, 4, 3, 64, 8, 1, 1.f, 0,
                                                     nullptr, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::decode_attention::forward(x.get(), x.get(), x.get(), x.get(), 1, 4, 2, 64, 8, 9, 1.f, 0,
                                                     nullptr, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::decode_attention::forward(x.get(), x.get(), x.get(), x.get(), 1, 4, 2, 64, 8, 0, 1.f, 0,
                                                     nullptr, nullptr),
               Error);
  EXPECT_THROW(ops::cuda::decode_attention::forward(x.get(), x.get(), x.get(), x.get(), 1, 4, 2, 64, 8, 1, 1.f, -1,
                                                     nullptr, nullptr),
               Error);
}

}  // namespace
}  // namespace keel

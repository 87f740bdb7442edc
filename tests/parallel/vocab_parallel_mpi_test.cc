// Vocabulary-parallel embedding and LM-head cross-entropy (parallel/vocab_parallel.h) on CPU
// ranks under MPI (run at 1 to 4 ranks, the tensor group being the world): every rank's loss and
// lse, the group sum of its dhidden partials, and its slice's dW equal ops::cross_entropy over
// the whole table; the group sum of the embedding partials equals ops::embedding, and each
// rank's table gradient is its slice of the single-rank one. Chunk sizes that divide the local
// vocabulary, that do not, of 1 column and of more than the slice; ignored targets; a non-unit
// dloss; out-of-range targets and token ids.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../error_message.h"
#include "../mpi_test_util.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "parallel/vocab_parallel.h"

namespace keel::parallel {
namespace {

namespace ce = ops::cross_entropy;
using keel::test::error_message;
using keel::test::world_rank;
using keel::test::world_size;

constexpr std::int64_t kVocab = 120;  // splits over 1, 2, 3, 4, 5, 6 and 8 ranks
constexpr std::int64_t kTokens = 41, kWidth = 24;

struct Lcg {
  std::uint64_t s;
  float next() {  // uniform in [-1, 1)
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>((s >> 40) * (1.0 / 8388608.0)) - 1.f;
  }
  std::uint32_t below(std::uint32_t n) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::uint32_t>((s >> 33) % n);
  }
};

std::vector<float> random_vec(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  Lcg g{seed};
  std::vector<float> v(n);
  for (auto& x : v) x = scale * g.next();
  return v;
}

// This rank's rows of the [kVocab, kWidth] table.
struct Slice {
  std::int64_t rows, begin;
  Slice() : rows(kVocab / world_size()), begin(world_rank() * (kVocab / world_size())) {}
  std::vector<float> of(const std::vector<float>& table) const {
    return std::vector<float>(table.begin() + std::ptrdiff_t(begin * kWidth), table.begin() + std::ptrdiff_t((begin + rows) * kWidth));
  }
};

// Targets over the whole vocabulary (every rank owns some), every fifth one ignored.
std::vector<std::int32_t> random_targets(std::uint64_t seed, std::int32_t ignore_index) {
  Lcg g{seed};
  std::vector<std::int32_t> t(kTokens);
  for (std::int64_t i = 0; i < kTokens; ++i) t[i] = i % 5 == 3 ? ignore_index : std::int32_t(g.below(kVocab));
  return t;
}

float group_min(float x) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_FLOAT, MPI_MIN, MPI_COMM_WORLD);
  return x;
}
float group_max(float x) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
  return x;
}

void check_cross_entropy(std::int64_t chunk, float dloss, std::int32_t ignore_index, std::uint64_t seed) {
  ASSERT_EQ(kVocab % world_size(), 0);
  const int rank = world_rank();
  const Slice sl;
  const std::int64_t N = kTokens, D = kWidth, V = kVocab, VL = sl.rows;
  // The same inputs on every rank (one seed); logits of a few units so the softmax is not flat.
  auto hidden = random_vec(std::size_t(N * D), seed);
  auto w = random_vec(std::size_t(V * D), seed + 1, 0.8f);
  const auto dw0 = random_vec(std::size_t(V * D), seed + 2, 0.1f);  // gradients accumulate onto these
  const auto targets = random_targets(seed + 3, ignore_index);
  const ce::Options o{chunk, ignore_index};

  // Reference: the whole table on one rank.
  std::vector<float> rlse(N), rscratch(ce::scratch_floats(N, std::min(chunk, V))), rdh(N * D), rdw = dw0;
  const float rloss = ce::forward(Tensor(hidden.data(), {N, D}), Tensor(w.data(), {V, D}), targets.data(), o,
                                  Tensor(rlse.data(), {N}), Tensor(rscratch.data(), {std::int64_t(rscratch.size())}));
  ce::backward(Tensor(hidden.data(), {N, D}), Tensor(w.data(), {V, D}), targets.data(), Tensor(rlse.data(), {N}), dloss, o,
               Tensor(rscratch.data(), {std::int64_t(rscratch.size())}), Tensor(rdh.data(), {N, D}),
               Tensor(rdw.data(), {V, D}));

  // Vocabulary parallel: this rank's slice.
  auto wl = sl.of(w), dwl = sl.of(dw0);
  std::vector<float> lse(N, -7.f), scratch(ce::scratch_floats(N, std::min(chunk, VL))), dh(N * D, 123.f);
  const Tensor sc(scratch.data(), {std::int64_t(scratch.size())});
  const float loss = vocab_ce_forward(Tensor(hidden.data(), {N, D}), Tensor(wl.data(), {VL, D}), sl.begin, V, targets.data(),
                                      o, Tensor(lse.data(), {N}), sc, MPI_COMM_WORLD);
  vocab_ce_backward(Tensor(hidden.data(), {N, D}), Tensor(wl.data(), {VL, D}), sl.begin, V, targets.data(),
                    Tensor(lse.data(), {N}), dloss, o, sc, Tensor(dh.data(), {N, D}), Tensor(dwl.data(), {VL, D}));

  ASSERT_GT(rloss, 0.5f);  // a real loss, not a degenerate one
  EXPECT_NEAR(loss, rloss, 1e-5f * std::fabs(rloss)) << "rank " << rank;
  EXPECT_EQ(group_min(loss), group_max(loss)) << "the loss differs between ranks";
  for (std::int64_t i = 0; i < N; ++i) {
    if (targets[i] == ignore_index) EXPECT_EQ(lse[i], 0.f) << "ignored row " << i;
    EXPECT_NEAR(lse[i], rlse[i], 1e-5f * (1.f + std::fabs(rlse[i]))) << "lse, rank " << rank << " row " << i;
  }
  // dhidden: the group sum of the partials (the caller's all-reduce).
  MPI_Allreduce(MPI_IN_PLACE, dh.data(), int(dh.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  for (std::int64_t i = 0; i < N * D; ++i) {
    if (targets[i / D] == ignore_index) ASSERT_EQ(dh[i], 0.f) << "ignored row " << i / D;
    ASSERT_NEAR(dh[i], rdh[i], 1e-5f * (1.f + std::fabs(rdh[i]))) << "dhidden, rank " << rank << " element " << i;
  }
  // dW: this rank's rows of the single-rank gradient, accumulated onto dw0.
  for (std::int64_t i = 0; i < VL * D; ++i) {
    const float want = rdw[sl.begin * D + i];
    ASSERT_NEAR(dwl[i], want, 1e-5f * (1.f + std::fabs(want))) << "dW, rank " << rank << " element " << i;
  }
}

TEST(VocabParallel, CrossEntropyChunkDividesSlice) { check_cross_entropy(5, 1.f, -1, 10); }         // 5 | 120/p
TEST(VocabParallel, CrossEntropyChunkDoesNotDivideSlice) { check_cross_entropy(7, 0.7f, -1, 20); }  // 7 divides no 120/p
TEST(VocabParallel, CrossEntropyOneColumnChunks) { check_cross_entropy(1, 1.f, -1, 30); }
TEST(VocabParallel, CrossEntropyChunkLargerThanSlice) { check_cross_entropy(8192, 2.5f, -100, 40); }

TEST(VocabParallel, CrossEntropyAllIgnored) {
  const Slice sl;
  const std::int64_t N = 6, D = kWidth, VL = sl.rows;
  auto hidden = random_vec(std::size_t(N * D), 50), wl = random_vec(std::size_t(VL * D), 51);
  const std::vector<std::int32_t> targets(N, -1);
  const std::vector<float> dw0 = random_vec(std::size_t(VL * D), 52);
  std::vector<float> lse(N, 3.f), scratch(ce::scratch_floats(N, VL)), dh(N * D, 9.f), dwl = dw0;
  const ce::Options o{16, -1};
  const Tensor sc(scratch.data(), {std::int64_t(scratch.size())});
  EXPECT_EQ(vocab_ce_forward(Tensor(hidden.data(), {N, D}), Tensor(wl.data(), {VL, D}), sl.begin, kVocab, targets.data(), o,
                             Tensor(lse.data(), {N}), sc, MPI_COMM_WORLD),
            0.f);
  vocab_ce_backward(Tensor(hidden.data(), {N, D}), Tensor(wl.data(), {VL, D}), sl.begin, kVocab, targets.data(),
                    Tensor(lse.data(), {N}), 1.f, o, sc, Tensor(dh.data(), {N, D}), Tensor(dwl.data(), {VL, D}));
  EXPECT_EQ(lse, std::vector<float>(N, 0.f));
  EXPECT_EQ(dh, std::vector<float>(N * D, 0.f));  // overwritten
  EXPECT_EQ(dwl, dw0);                            // nothing accumulated
}

TEST(VocabParallel, CrossEntropyTargetOutsideVocabularyThrows) {
  const Slice sl;
  const std::int64_t N = 4, D = kWidth, VL = sl.rows;
  auto hidden = random_vec(std::size_t(N * D), 60), wl = random_vec(std::size_t(VL * D), 61);
  std::vector<float> lse(N), scratch(ce::scratch_floats(N, VL)), dh(N * D), dwl(VL * D);
  const Tensor sc(scratch.data(), {std::int64_t(scratch.size())});
  const ce::Options o{16, -100};
  // The same bad target on every rank: every rank throws before any collective.
  for (const std::int32_t bad : {std::int32_t(kVocab), std::int32_t(-1)}) {
    const std::vector<std::int32_t> targets{3, -100, bad, 0};
    const std::string value = std::to_string(bad);
    const std::string fwd = error_message([&] {
      vocab_ce_forward(Tensor(hidden.data(), {N, D}), Tensor(wl.data(), {VL, D}), sl.begin, kVocab, targets.data(), o,
                       Tensor(lse.data(), {N}), sc, MPI_COMM_WORLD);
    });
    EXPECT_NE(fwd.find("target " + value + " at position 2"), std::string::npos) << fwd;
    const std::string bwd = error_message([&] {
      vocab_ce_backward(Tensor(hidden.data(), {N, D}), Tensor(wl.data(), {VL, D}), sl.begin, kVocab, targets.data(),
                        Tensor(lse.data(), {N}), 1.f, o, sc, Tensor(dh.data(), {N, D}), Tensor(dwl.data(), {VL, D}));
    });
    EXPECT_NE(bwd.find("target " + value + " at position 2"), std::string::npos) << bwd;
  }
}

TEST(VocabParallel, CrossEntropySlicesThatDoNotCoverTheVocabularyThrow) {
  // Every rank claims a slice one row short: the group holds fewer rows than the vocabulary.
  const Slice sl;
  const std::int64_t N = 4, D = kWidth, VL = sl.rows - 1;
  auto hidden = random_vec(std::size_t(N * D), 70), wl = random_vec(std::size_t(VL * D), 71);
  std::vector<float> lse(N), scratch(ce::scratch_floats(N, VL));
  const std::vector<std::int32_t> targets{0, 1, 2, 3};
  const std::string msg = error_message([&] {
    vocab_ce_forward(Tensor(hidden.data(), {N, D}), Tensor(wl.data(), {VL, D}), sl.begin, kVocab, targets.data(), {16, -1},
                     Tensor(lse.data(), {N}), Tensor(scratch.data(), {std::int64_t(scratch.size())}), MPI_COMM_WORLD);
  });
  EXPECT_NE(msg.find("the group's slices hold " + std::to_string(kVocab - world_size())), std::string::npos) << msg;
}

TEST(VocabParallel, Embedding) {
  const int rank = world_rank();
  const Slice sl;
  const std::int64_t N = kTokens, D = kWidth, V = kVocab, VL = sl.rows;
  auto table = random_vec(std::size_t(V * D), 80);
  const auto dt0 = random_vec(std::size_t(V * D), 81, 0.1f);
  auto dout = random_vec(std::size_t(N * D), 82);
  std::vector<std::uint32_t> tokens(N);
  Lcg g{83};
  for (auto& t : tokens) t = g.below(std::uint32_t(V));
  tokens[0] = tokens[N - 1] = std::uint32_t(V - 1), tokens[1] = 0;  // repeats, both ends of the vocabulary

  std::vector<float> ref(N * D), rdt = dt0;
  ops::embedding::forward(tokens.data(), N, Tensor(table.data(), {V, D}), Tensor(ref.data(), {N, D}));
  ops::embedding::backward(tokens.data(), N, Tensor(dout.data(), {N, D}), Tensor(rdt.data(), {V, D}));

  auto wl = sl.of(table), dwl = sl.of(dt0);
  std::vector<float> out(N * D, 5.f);  // overwritten
  vocab_embedding_forward(tokens.data(), N, Tensor(wl.data(), {VL, D}), sl.begin, V, Tensor(out.data(), {N, D}));
  for (std::int64_t i = 0; i < N; ++i) {
    const bool mine = tokens[i] >= sl.begin && tokens[i] < sl.begin + VL;
    for (std::int64_t j = 0; j < D; ++j)
      ASSERT_EQ(out[i * D + j], mine ? ref[i * D + j] : 0.f) << "rank " << rank << " token " << i;
  }
  // One rank holds each row and the others add zeros: the group sum is exact.
  MPI_Allreduce(MPI_IN_PLACE, out.data(), int(out.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(out, ref);
  // Backward: the same sequential scatter-add over this rank's rows, bit for bit.
  vocab_embedding_backward(tokens.data(), N, Tensor(dout.data(), {N, D}), sl.begin, V, Tensor(dwl.data(), {VL, D}));
  EXPECT_EQ(dwl, sl.of(rdt)) << "rank " << rank;
}

TEST(VocabParallel, EmbeddingTokenOutsideVocabularyThrows) {
  const Slice sl;
  const std::int64_t D = kWidth, VL = sl.rows;
  std::vector<float> wl(VL * D), out(3 * D);
  // Ids of other ranks' rows are fine; an id >= V is not, on every rank.
  const std::vector<std::uint32_t> ok{0, std::uint32_t(kVocab - 1), 7};
  vocab_embedding_forward(ok.data(), 3, Tensor(wl.data(), {VL, D}), sl.begin, kVocab, Tensor(out.data(), {3, D}));
  const std::vector<std::uint32_t> bad{0, 5, std::uint32_t(kVocab)};
  const std::string fwd = error_message(
      [&] { vocab_embedding_forward(bad.data(), 3, Tensor(wl.data(), {VL, D}), sl.begin, kVocab, Tensor(out.data(), {3, D})); });
  EXPECT_NE(fwd.find("token id " + std::to_string(kVocab) + " at position 2"), std::string::npos) << fwd;
  const std::string bwd = error_message(
      [&] { vocab_embedding_backward(bad.data(), 3, Tensor(out.data(), {3, D}), sl.begin, kVocab, Tensor(wl.data(), {VL, D})); });
  EXPECT_NE(bwd.find("token id " + std::to_string(kVocab) + " at position 2"), std::string::npos) << bwd;
}

}  // namespace
}  // namespace keel::parallel

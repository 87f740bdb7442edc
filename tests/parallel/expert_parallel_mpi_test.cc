// Expert-parallel MoE (parallel/expert_parallel.h) on CPU ranks under MPI (run at 2, 3 and 4
// ranks, the expert-parallel group being the world): every rank's outputs, input and gate
// gradients, and its local experts' weight gradients equal the single-rank moe::forward /
// backward over the tokens of all ranks, for uneven token counts, top-1 and top-2, and routing
// that leaves experts and whole ranks without tokens.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../mpi_test_util.h"
#include "common/error.h"
#include "ops/moe.h"
#include "parallel/expert_parallel.h"

namespace keel::parallel {
namespace {

using keel::test::world_rank;
using keel::test::world_size;

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

std::vector<float> random_vec(std::size_t n, std::uint64_t seed) {
  Lcg g{seed};
  std::vector<float> v(n);
  for (auto& x : v) x = g.next();
  return v;
}

// Concatenates every rank's vector in rank order.
template <typename T>
std::vector<T> all_gather(const std::vector<T>& mine, MPI_Datatype type) {
  const int p = world_size();
  int n = static_cast<int>(mine.size());
  std::vector<int> counts(p), displs(p);
  MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int i = 0; i < p; ++i) displs[i] = total, total += counts[i];
  std::vector<T> all(static_cast<std::size_t>(total));
  MPI_Allgatherv(mine.data(), n, type, all.data(), counts.data(), displs.data(), type, MPI_COMM_WORLD);
  return all;
}

enum class Routing { kRandom, kFirstRankOnly, kOneExpert };

void check_against_single_rank(int top_k, Routing routing) {
  const int p = world_size(), rank = world_rank();
  const int E = 24, D = 8, F = 6;  // splits over 1, 2, 3, 4 and 8 ranks
  ASSERT_EQ(E % p, 0);
  ExpertParallelMoe ep(MPI_COMM_WORLD, E);
  const int el = ep.local_experts(), e0 = ep.first_expert();
  // Whole-layer weights, the same on every rank (one seed); each rank holds its slice.
  const auto wg = random_vec(std::size_t(E) * F * D, 11), wu = random_vec(std::size_t(E) * F * D, 12),
             wd = random_vec(std::size_t(E) * D * F, 13);
  // This rank's tokens: an uneven count per rank.
  const std::int64_t n = 5 + 3 * rank;
  const auto x = random_vec(std::size_t(n) * D, 100 + rank), dy = random_vec(std::size_t(n) * D, 200 + rank);
  auto gates = random_vec(std::size_t(n) * top_k, 300 + rank);
  for (auto& g : gates) g = 0.5f + 0.25f * g;
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n * top_k));
  Lcg pick{400 + std::uint64_t(rank)};
  for (std::int64_t i = 0; i < n; ++i)
    for (int k = 0; k < top_k; ++k) {
      std::int32_t e = 0;
      if (routing == Routing::kRandom) e = static_cast<std::int32_t>(pick.below(E));
      if (routing == Routing::kFirstRankOnly) e = static_cast<std::int32_t>(pick.below(el));  // experts of rank 0
      if (routing == Routing::kOneExpert) e = E - 1;
      // top-k choices of one token are distinct experts
      if (k > 0 && e == idx[i * top_k]) e = (e + 1) % (routing == Routing::kFirstRankOnly ? el : E);
      idx[i * top_k + k] = e;
    }

  // Expert parallel.
  auto slice = [&](const std::vector<float>& w, std::size_t per_expert) {
    return std::vector<float>(w.begin() + std::ptrdiff_t(e0 * per_expert), w.begin() + std::ptrdiff_t((e0 + el) * per_expert));
  };
  auto lwg = slice(wg, std::size_t(F) * D), lwu = slice(wu, std::size_t(F) * D), lwd = slice(wd, std::size_t(D) * F);
  const ops::moe::Weights local{Tensor(lwg.data(), {el, F, D}), Tensor(lwu.data(), {el, F, D}), Tensor(lwd.data(), {el, D, F})};
  std::vector<float> y(std::size_t(n) * D), dx(std::size_t(n) * D), dgates(std::size_t(n) * top_k);
  std::vector<float> gwg(lwg.size(), 0.f), gwu(lwu.size(), 0.f), gwd(lwd.size(), 0.f);
  auto xc = x, gc = gates, dyc = dy;
  ep.forward(ops::moe::make_plan(idx.data(), n, top_k, E), Tensor(xc.data(), {n, D}), Tensor(gc.data(), {n, top_k}), local,
             Tensor(y.data(), {n, D}));
  ep.backward(Tensor(dyc.data(), {n, D}), local, Tensor(dx.data(), {n, D}), Tensor(dgates.data(), {n, top_k}),
              {Tensor(gwg.data(), {el, F, D}), Tensor(gwu.data(), {el, F, D}), Tensor(gwd.data(), {el, D, F})});

  // Reference: one rank, every rank's tokens, all experts.
  auto ax = all_gather(x, MPI_FLOAT), ady = all_gather(dy, MPI_FLOAT), ag = all_gather(gates, MPI_FLOAT);
  auto aidx = all_gather(idx, MPI_INT32_T);
  const std::int64_t total = static_cast<std::int64_t>(ax.size()) / D, s = total * top_k;
  std::int64_t before = 0;  // this rank's first row in the gathered batch
  for (int r = 0; r < rank; ++r) before += 5 + 3 * r;
  const auto plan = ops::moe::make_plan(aidx.data(), total, top_k, E);
  std::vector<float> xs(s * D), hg(s * F), hu(s * F), act(s * F), ys(s * D), ry(total * D), rdx(total * D), rdg(s);
  std::vector<float> rgwg(wg.size(), 0.f), rgwu(wu.size(), 0.f), rgwd(wd.size(), 0.f);
  auto cwg = wg, cwu = wu, cwd = wd;
  const ops::moe::Weights full{Tensor(cwg.data(), {E, F, D}), Tensor(cwu.data(), {E, F, D}), Tensor(cwd.data(), {E, D, F})};
  const ops::moe::Saved sv{Tensor(xs.data(), {s, D}), Tensor(hg.data(), {s, F}), Tensor(hu.data(), {s, F}),
                           Tensor(act.data(), {s, F}), Tensor(ys.data(), {s, D})};
  ops::moe::forward(plan, Tensor(ax.data(), {total, D}), Tensor(ag.data(), {total, top_k}), full, sv, Tensor(ry.data(), {total, D}));
  std::vector<float> scratch(ops::moe::backward_scratch_floats(s, D, F));
  ops::moe::backward(plan, Tensor(ax.data(), {total, D}), Tensor(ag.data(), {total, top_k}), full, sv,
                     Tensor(ady.data(), {total, D}), Tensor(scratch.data(), {std::int64_t(scratch.size())}),
                     Tensor(rdx.data(), {total, D}), Tensor(rdg.data(), {total, top_k}),
                     {Tensor(rgwg.data(), {E, F, D}), Tensor(rgwu.data(), {E, F, D}), Tensor(rgwd.data(), {E, D, F})});

  // Same rows, same GEMMs per expert: outputs and token gradients agree to rounding.
  for (std::int64_t i = 0; i < n * D; ++i) {
    ASSERT_NEAR(y[i], ry[before * D + i], 1e-5f) << "y, rank " << rank << " element " << i;
    ASSERT_NEAR(dx[i], rdx[before * D + i], 1e-5f) << "dx, rank " << rank << " element " << i;
  }
  for (std::int64_t i = 0; i < n * top_k; ++i) ASSERT_NEAR(dgates[i], rdg[before * top_k + i], 1e-5f) << "dgates " << i;
  // Local experts' weight gradients: every token of the group routed to them (summation order differs).
  auto expect_slice = [&](const std::vector<float>& got, const std::vector<float>& ref, std::size_t per_expert, const char* what) {
    for (std::size_t i = 0; i < got.size(); ++i) {
      const float want = ref[e0 * per_expert + i];
      ASSERT_NEAR(got[i], want, 1e-4f * (1.f + std::fabs(want))) << what << ", rank " << rank << " element " << i;
    }
  };
  expect_slice(gwg, rgwg, std::size_t(F) * D, "dW_gate");
  expect_slice(gwu, rgwu, std::size_t(F) * D, "dW_up");
  expect_slice(gwd, rgwd, std::size_t(D) * F, "dW_down");
  // The rows this rank computed are exactly its experts' load over the group.
  std::int64_t load = 0;
  for (int e = e0; e < e0 + el; ++e) load += plan.counts[e];
  EXPECT_EQ(ep.received_rows(), load);
}

TEST(ExpertParallelMpi, Top1RandomRoutingMatchesOneRank) { check_against_single_rank(1, Routing::kRandom); }
TEST(ExpertParallelMpi, Top2RandomRoutingMatchesOneRank) { check_against_single_rank(2, Routing::kRandom); }
TEST(ExpertParallelMpi, RanksWithoutTokensForTheirExperts) { check_against_single_rank(2, Routing::kFirstRankOnly); }
TEST(ExpertParallelMpi, EveryTokenToOneExpert) { check_against_single_rank(1, Routing::kOneExpert); }

TEST(ExpertParallelMpi, ExpertsMustSplitOverTheGroup) {
  if (world_size() == 1) GTEST_SKIP() << "needs several ranks";
  const int experts = world_size() + 1;  // never a multiple of the group size (> 1)
  try {
    ExpertParallelMoe ep(MPI_COMM_WORLD, experts);
    FAIL() << "accepted " << experts << " experts over " << world_size() << " ranks";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("do not split over"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace keel::parallel

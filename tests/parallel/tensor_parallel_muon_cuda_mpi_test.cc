// Muon over tensor-parallel shards on GPUs (parallel/tensor_parallel_muon_cuda.h; one GPU per
// rank, the world one tensor group; skipped without a GPU per rank or without CUDA): given the
// same gradients, every rank's blocks after CudaTensorParallelMuon::step equal the same elements
// of ops::cuda::muon::matrix_step on the whole matrices on one GPU: the momentum bit for bit (the
// same elementwise operations), the parameters to fp32 rounding (the owner orthogonalizes the
// same whole matrix with the same GEMMs; only the last multiply-subtract is grouped differently).
// Covered: row blocks (column-parallel), column blocks (row-parallel), a fused tensor of row parts
// (CCA's [q; k]), an expert stack whose matrices rotate over owners, a parameter with an lr
// scale and no decay; a replicated Muon matrix and an AdamW vector are left alone.
#if defined(KEEL_HAVE_CUDA)

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <vector>

#include "../mpi_test_util.h"
#include "../ops/cuda/cuda_test_util.h"
#include "device/cuda_devices.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/muon.h"
#include "parallel/nccl_group.h"
#include "parallel/tensor_parallel_muon_cuda.h"

namespace keel::parallel {
namespace {

using keel::test::world_rank;
using keel::test::world_size;

enum class Cut { kNone, kRows, kCols };

struct Spec {
  const char* name;
  std::vector<std::int64_t> whole;  // [E,] R, C
  Cut cut;
  std::vector<std::int64_t> parts;  // row parts of the whole (kRows)
  optim::OptimizerKind kind = optim::OptimizerKind::kMuon;
  double lr_scale = 1.0;
  bool decay = true;
};

// Rank r's block of a whole [E, R, C] tensor (row-major), as the placements cut it.
std::vector<float> block_of(const Spec& s, const std::vector<float>& whole, int r, int T) {
  const std::int64_t C = s.whole.back(), R = s.whole.size() >= 2 ? s.whole[s.whole.size() - 2] : 1;
  const std::int64_t E = static_cast<std::int64_t>(whole.size()) / (R * C);
  std::vector<float> out;
  for (std::int64_t e = 0; e < E; ++e) {
    const float* m = whole.data() + e * R * C;
    if (s.cut == Cut::kNone) {
      out.insert(out.end(), m, m + R * C);
    } else if (s.cut == Cut::kCols) {
      const std::int64_t lc = C / T;
      for (std::int64_t i = 0; i < R; ++i) out.insert(out.end(), m + i * C + r * lc, m + i * C + (r + 1) * lc);
    } else {
      const std::vector<std::int64_t> parts = s.parts.empty() ? std::vector<std::int64_t>{R} : s.parts;
      std::int64_t at = 0;
      for (std::int64_t part : parts) {
        const std::int64_t n = part / T;
        out.insert(out.end(), m + (at + r * n) * C, m + (at + (r + 1) * n) * C);
        at += part;
      }
    }
  }
  return out;
}

TEST(TensorParallelMuonCuda, BlocksEqualTheWholeMatrixStep) {
  const int T = world_size(), me = world_rank();
  if (T < 2 || visible_cuda_devices() < T) GTEST_SKIP() << "needs a GPU per rank";
  set_cuda_device(me);
  const std::vector<Spec> specs = {
      {"rows", {8 * T, 24}, Cut::kRows, {}},
      {"cols", {16, 8 * T}, Cut::kCols, {}},
      {"stack", {3, 8 * T, 16}, Cut::kRows, {}},
      {"parts", {12 * T, 16}, Cut::kRows, {8 * T, 4 * T}, optim::OptimizerKind::kMuon, 0.5, false},
      {"replicated", {8, 8}, Cut::kNone, {}},
      {"vector", {8}, Cut::kNone, {}, optim::OptimizerKind::kAdamW},
  };
  // The local layout (this rank's blocks) and the whole one.
  optim::ParamLayout local;
  std::int64_t at = 0;
  for (const Spec& s : specs) {
    optim::ParamInfo p;
    p.name = s.name;
    p.global_shape = s.whole;
    p.shape = s.whole;
    const int nd = static_cast<int>(s.whole.size());
    p.placement = mesh::Placement::replicated(nd);
    if (s.cut == Cut::kRows) {
      p.shape[nd - 2] /= T;
      p.placement.dims[nd - 2].push_back(mesh::Axis::kTensor);
      p.placement.parts = s.parts;
    } else if (s.cut == Cut::kCols) {
      p.shape[nd - 1] /= T;
      p.placement.dims[nd - 1].push_back(mesh::Axis::kTensor);
    }
    p.optimizer = s.kind;
    p.lr_scale = s.lr_scale;
    p.weight_decay = s.decay;
    p.numel = 1;
    for (auto d : p.shape) p.numel *= d;
    p.offset = at;
    at += (p.numel + 3) / 4 * 4;
    local.params.push_back(p);
  }
  local.total_floats = at;

  optim::MuonConfig c;  // defaults: Nesterov, 5 steps, match_adamw scale
  c.weight_decay = 0.1;
  const double lr = 0.02;
  cudaStream_t stream = nullptr;
  KEEL_CUDA_CHECK(cudaStreamCreate(&stream));
  auto& gemm = ops::cuda::thread_gemm();
  const auto coef = test::to_device<float>(std::vector<float>{0.5f});  // a clip coefficient

  // Whole tensors (the same on every rank: seeded by parameter), stepped on this GPU alone.
  std::vector<std::vector<float>> want_p, want_m;
  std::vector<float> lp(static_cast<std::size_t>(local.total_floats), 0.f), lg = lp, lm = lp;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    std::int64_t n = 1;
    for (auto d : s.whole) n *= d;
    const auto p = test::random_vector(n, 100 + 3 * i, -1.f, 1.f);
    const auto g = test::random_vector(n, 101 + 3 * i, -1.f, 1.f);
    const auto m = test::random_vector(n, 102 + 3 * i, -0.1f, 0.1f);
    const optim::ParamInfo& info = local.params[i];
    for (const auto& [src, dst] : {std::pair{&p, &lp}, std::pair{&g, &lg}, std::pair{&m, &lm}}) {
      const auto b = block_of(s, *src, me, T);
      std::copy(b.begin(), b.end(), dst->begin() + info.offset);
    }
    if (s.kind != optim::OptimizerKind::kMuon || s.cut == Cut::kNone) {  // not stepped here: unchanged
      want_p.push_back(block_of(s, p, me, T));
      want_m.push_back(block_of(s, m, me, T));
      continue;
    }
    const std::int64_t C = s.whole.back(), R = s.whole[s.whole.size() - 2], E = n / (R * C);
    auto dp = test::to_device<float>(p), dg = test::to_device<float>(g), dm = test::to_device<float>(m);
    test::DeviceArray<unsigned char> ws(ops::cuda::muon::workspace_bytes(E, R, C));
    ops::cuda::muon::matrix_step(dp.get(), dg.get(), dm.get(), nullptr, E, R, C, c, lr * s.lr_scale, s.decay, 1.0f,
                                 coef.get(), ws.get(), gemm, stream);
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream));
    want_p.push_back(block_of(s, test::to_host(dp), me, T));
    want_m.push_back(block_of(s, test::to_host(dm), me, T));
  }

  // This rank's blocks through the tensor group.
  std::shared_ptr<NcclGroup> group = make_nccl_group(MPI_COMM_WORLD);
  CudaTensorParallelMuon tp(c, local, group);
  for (std::size_t i = 0; i < specs.size(); ++i)
    EXPECT_EQ(tp.owns(i), specs[i].kind == optim::OptimizerKind::kMuon && specs[i].cut != Cut::kNone) << specs[i].name;
  auto dp = test::to_device<float>(lp), dg = test::to_device<float>(lg), dm = test::to_device<float>(lm);
  test::DeviceArray<ops::cuda::bf16> dbf(lp.size());
  tp.step(dp.get(), dg.get(), dm.get(), dbf.get(), lr, coef.get(), gemm, stream);
  KEEL_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto got_p = test::to_host(dp), got_m = test::to_host(dm);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const optim::ParamInfo& info = local.params[i];
    const std::vector<float> gp(got_p.begin() + info.offset, got_p.begin() + info.offset + info.numel),
        gm(got_m.begin() + info.offset, got_m.begin() + info.offset + info.numel);
    EXPECT_EQ(gm, want_m[i]) << specs[i].name << ": momentum";
    const std::vector<float> before(lp.begin() + info.offset, lp.begin() + info.offset + info.numel);
    double worst = 0, step = 0;
    for (std::int64_t k = 0; k < info.numel; ++k) {
      worst = std::max(worst, std::fabs(double(gp[k]) - want_p[i][k]));
      step = std::max(step, std::fabs(double(want_p[i][k]) - before[k]));
    }
    if (tp.owns(i)) {
      EXPECT_GT(step, 0.0) << specs[i].name << ": stepped";
      EXPECT_LE(worst, 1e-6 + 1e-5 * step) << specs[i].name << ": parameters";
    } else {
      EXPECT_EQ(gp, want_p[i]) << specs[i].name << ": left alone";
    }
  }
  KEEL_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace keel::parallel

#endif  // KEEL_HAVE_CUDA

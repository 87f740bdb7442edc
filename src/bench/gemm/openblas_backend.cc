// `keel bench gemm --backend cpu`: fp32 GEMMs through OpenBLAS (cblas_sgemm), timed with the
// host clock while cycling through enough operand sets to stream them from DRAM rather than
// the last-level cache. CI measures and checks this path.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "common/hash.h"
#include "bench/gemm/backend.h"
#include "common/error.h"
#include "common/host.h"
#include "common/units.h"

namespace keel::bench {
namespace {

void fill(float* p, std::uint64_t count, std::uint64_t seed) {
  const std::uint64_t key = keel::splitmix64(seed);
  for (std::uint64_t i = 0; i < count; ++i) p[i] = static_cast<float>(keel::splitmix64(key ^ i) >> 40) * 0x1p-23f - 1.0f;
}

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

class OpenBlasBackend final : public GemmBackend {
 public:
  explicit OpenBlasBackend(int threads) {
    if (threads > 0) openblas_set_num_threads(threads);
    threads_ = openblas_get_num_threads();
  }

  std::string name() const override { return "openblas"; }

  GemmDevice device() const override {
    GemmDevice d;
    d.name = host_cpu_model();
    d.sm_count = threads_;
    d.l2_bytes = host_last_level_cache_bytes();
    d.memory_bytes = host_physical_bytes();
    return d;
  }

  std::map<std::string, std::string> library_versions() const override {
    std::string config = openblas_get_config();
    while (!config.empty() && config.back() == ' ') config.pop_back();
    return {{"openblas", config}, {"threads", std::to_string(threads_)}};
  }

  std::string unsupported_type(GemmType t) const override {
    if (t == GemmType::kFP32) return "";
    return fmt::format("--backend cpu runs fp32 only (OpenBLAS sgemm); {} needs a GPU", gemm_type_name(t));
  }

  void check_fits(const GemmShape& s, GemmType t, const GemmPlan& plan) const override {
    const std::uint64_t need = set_bytes(s);
    const std::uint64_t have = host_available_bytes();
    if (need > have * 9 / 10)
      fail("out of memory: {}x{}x{} {} needs {} of host memory (A, B and C) but {} is available", s.m, s.n, s.k,
           gemm_type_name(t), format_size(need), format_size(have));
  }

  GemmResult run(const GemmShape& s, GemmType t, const GemmPlan& plan,
                 const std::vector<std::array<std::int64_t, 3>>& positions) override {
    check_fits(s, t, plan);
    GemmResult r;
    const std::uint64_t ea = static_cast<std::uint64_t>(s.m * s.k * s.batch), eb = static_cast<std::uint64_t>(s.k * s.n * s.batch),
                        ec = static_cast<std::uint64_t>(s.m * s.n * s.batch);
    const std::uint64_t per = set_bytes(s);
    const std::uint64_t llc = std::max<std::uint64_t>(device().l2_bytes, 1 << 20);
    // Twice the last-level cache (sysconf reports all of a socket's, so this is generous),
    // at most 1 GiB: filling more would cost more than the timing gains.
    const std::uint64_t target = plan.rotate_bytes ? plan.rotate_bytes : std::min<std::uint64_t>(2 * llc, 1ull << 30);
    std::uint64_t sets = std::max<std::uint64_t>(1, (target + per - 1) / per);
    sets = std::max<std::uint64_t>(1, std::min(sets, host_available_bytes() / 2 / per));
    r.rotating_sets = static_cast<int>(sets);
    std::vector<std::unique_ptr<float, FreeDeleter>> A, B, C;
    auto alloc = [&](std::uint64_t n) {
      float* p = static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64));
      if (!p) fail("out of memory: could not allocate {} of host memory", format_size(n * 4));
      return std::unique_ptr<float, FreeDeleter>(p);
    };
    for (std::uint64_t i = 0; i < sets; ++i) {
      A.push_back(alloc(ea));
      B.push_back(alloc(eb));
      C.push_back(alloc(ec));
      fill(A.back().get(), ea, plan.seed * 7919 + 2 * i);
      fill(B.back().get(), eb, plan.seed * 7919 + 2 * i + 1);
      std::fill(C.back().get(), C.back().get() + ec, std::numeric_limits<float>::quiet_NaN());
    }
    auto gemm = [&](std::uint64_t i) {
      const bool at = a_transposed(s.layout), bt = b_transposed(s.layout);
      for (std::int64_t b = 0; b < s.batch; ++b)
        cblas_sgemm(CblasRowMajor, at ? CblasTrans : CblasNoTrans, bt ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(s.m), static_cast<blasint>(s.n), static_cast<blasint>(s.k), 1.0f,
                    A[i].get() + b * s.m * s.k, static_cast<blasint>(at ? s.m : s.k), B[i].get() + b * s.k * s.n,
                    static_cast<blasint>(bt ? s.k : s.n), 0.0f, C[i].get() + b * s.m * s.n, static_cast<blasint>(s.n));
    };
    r.algo.source = "openblas";
    r.algo.description = fmt::format("cblas_sgemm {}{}, {} threads", a_transposed(s.layout) ? "T" : "N",
                                     b_transposed(s.layout) ? "T" : "N", threads_);
    using clock = std::chrono::steady_clock;
    for (int w = 0; w < std::max(plan.warmup, 1); ++w) gemm(static_cast<std::uint64_t>(w) % sets);
    for (int it = 0; it < plan.iters; ++it) {
      const auto t0 = clock::now();
      gemm(static_cast<std::uint64_t>(it) % sets);
      r.seconds.push_back(std::chrono::duration<double>(clock::now() - t0).count());
    }

    if (plan.check) {
      // Fresh inputs in set 0, output poisoned, one run, then the sampled check.
      fill(A[0].get(), ea, plan.seed * 104729 + 11);
      fill(B[0].get(), eb, plan.seed * 104729 + 12);
      std::fill(C[0].get(), C[0].get() + ec, std::numeric_limits<float>::quiet_NaN());
      gemm(0);
      if (plan.corrupt && !positions.empty()) {
        const auto& p = positions.front();
        C[0].get()[p[0] * s.m * s.n + p[1] * s.n + p[2]] = 12288.f;
      }
      r.checked = true;
      for (std::uint64_t i = 0; i < ec; ++i) r.nonfinite += !std::isfinite(C[0].get()[i]);
      const bool at = a_transposed(s.layout), bt = b_transposed(s.layout);
      for (const auto& p : positions) {
        GemmSample smp;
        smp.batch = p[0], smp.i = p[1], smp.j = p[2];
        const float* a = A[0].get() + p[0] * s.m * s.k;
        const float* b = B[0].get() + p[0] * s.k * s.n;
        for (std::int64_t q = 0; q < s.k; ++q) {
          smp.a.push_back(at ? a[q * s.m + p[1]] : a[p[1] * s.k + q]);
          smp.b.push_back(bt ? b[p[2] * s.k + q] : b[q * s.n + p[2]]);
        }
        smp.got = C[0].get()[p[0] * s.m * s.n + p[1] * s.n + p[2]];
        r.samples.push_back(std::move(smp));
      }
    }
    return r;
  }

 private:
  static std::uint64_t set_bytes(const GemmShape& s) {
    return 4 * static_cast<std::uint64_t>(s.m * s.k + s.k * s.n + s.m * s.n) * static_cast<std::uint64_t>(s.batch);
  }
  int threads_ = 1;
};

}  // namespace

std::unique_ptr<GemmBackend> make_openblas_backend(int threads) { return std::make_unique<OpenBlasBackend>(threads); }

}  // namespace keel::bench

// `keel bench mem --backend cpu`: the BabelStream kernels on host memory, each run split into
// static slices over a team of threads (what STREAM's OpenMP loops do), and memcpy as the
// CPU's copy engine. CI measures and checks this path.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#include "bench/mem/backend.h"
#include "bench/mem/host_verify.h"
#include "bench/mem/thread_team.h"
#include "bench/mem/values.h"
#include "common/error.h"
#include "common/host.h"
#include "common/units.h"

namespace keel::bench {
namespace {

constexpr std::uint64_t kDotChunk = 1024;  // T-precision partial sums before a double add
constexpr int kDotLanes = 8;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using HostArray = std::unique_ptr<void, FreeDeleter>;

HostArray allocate(std::uint64_t bytes) {
  const std::uint64_t rounded = (std::max<std::uint64_t>(bytes, 1) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) fail("out of host memory allocating {} for bench mem", format_size(bytes));
  return HostArray(p);
}

class CpuMemBackend final : public MemBackend {
 public:
  explicit CpuMemBackend(int threads) : team_(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency())) {}

  std::string name() const override { return "cpu"; }

  std::vector<MemDevice> devices() const override {
    MemDevice d;
    d.name = host_cpu_model();
    d.sm_count = team_.size();
    d.l2_bytes = host_last_level_cache_bytes();
    d.memory_bytes = host_physical_bytes();
    return {d};
  }

  std::map<std::string, std::string> library_versions() const override {
    return {{"threads", std::to_string(team_.size())}};
  }

  std::string unsupported_reason(MemOp op) const override {
    if (is_stream_kernel(op) || op == MemOp::kMemcpy) return "";
    return "needs a GPU: --backend cuda";
  }

  void check_fits(const MemCase& c) const override {
    const std::uint64_t need = static_cast<std::uint64_t>(arrays_needed(c.op)) * c.elements * mem_type_size(c.type);
    const std::uint64_t have = host_available_bytes();
    if (need > have * 9 / 10)
      fail("out of memory: {} of {} needs {} of host memory ({} arrays of {}) but only {} is available",
           mem_op_name(c.op), format_size(c.elements * mem_type_size(c.type)), format_size(need), arrays_needed(c.op),
           format_size(c.elements * mem_type_size(c.type)), format_size(have));
  }

  MemResult run(const MemCase& c, const MemPlan& plan) override {
    return c.type == MemType::kF32 ? run_typed<float>(c, plan) : run_typed<double>(c, plan);
  }

 private:
  template <typename T>
  MemResult run_typed(const MemCase& c, const MemPlan& plan) {
    check_fits(c);
    const std::uint64_t n = c.elements;
    HostArray ha = allocate(n * sizeof(T)), hb = allocate(n * sizeof(T)), hc = allocate(n * sizeof(T));
    T* a = static_cast<T*>(ha.get());
    T* b = static_cast<T*>(hb.get());
    T* cc = static_cast<T*>(hc.get());
    const std::uint64_t seed = plan.seed;
    // First touch by the member that will use the slice; the output of copy starts as NaN so
    // an element the kernel skips cannot pass the check.
    team_.run([&](int t, int nt) {
      std::uint64_t lo, hi;
      ThreadTeam::slice(n, t, nt, &lo, &hi);
      for (std::uint64_t i = lo; i < hi; ++i) {
        a[i] = static_cast<T>(stream_input(seed, kArrayA, i));
        b[i] = static_cast<T>(stream_input(seed, kArrayB, i));
        cc[i] = static_cast<T>(stream_input(seed, kArrayC, i));
      }
      if (c.op == MemOp::kCopy || c.op == MemOp::kMemcpy)
        for (std::uint64_t i = lo; i < hi; ++i) cc[i] = std::numeric_limits<T>::quiet_NaN();
    });

    const T scalar = static_cast<T>(kStreamScalar);
    std::vector<double> partial(static_cast<std::size_t>(team_.size()), 0.0);
    auto once = [&] {
      team_.run([&](int t, int nt) {
        std::uint64_t lo, hi;
        ThreadTeam::slice(n, t, nt, &lo, &hi);
        switch (c.op) {
          case MemOp::kCopy:
            for (std::uint64_t i = lo; i < hi; ++i) cc[i] = a[i];
            break;
          case MemOp::kMul:
            for (std::uint64_t i = lo; i < hi; ++i) b[i] = scalar * cc[i];
            break;
          case MemOp::kAdd:
            for (std::uint64_t i = lo; i < hi; ++i) cc[i] = a[i] + b[i];
            break;
          case MemOp::kTriad:
            for (std::uint64_t i = lo; i < hi; ++i) a[i] = b[i] + scalar * cc[i];
            break;
          case MemOp::kNstream:
            for (std::uint64_t i = lo; i < hi; ++i) a[i] += b[i] + scalar * cc[i];
            break;
          case MemOp::kDot: {
            double sum = 0;
            for (std::uint64_t i0 = lo; i0 < hi; i0 += kDotChunk) {
              const std::uint64_t i1 = std::min(hi, i0 + kDotChunk);
              // Eight independent T accumulators: a chain the compiler can vectorize, as
              // a GPU's per-thread sums are.
              T acc[kDotLanes] = {};
              std::uint64_t i = i0;
              for (; i + kDotLanes <= i1; i += kDotLanes)
                for (int l = 0; l < kDotLanes; ++l) acc[l] += a[i + l] * b[i + l];
              for (; i < i1; ++i) acc[0] += a[i] * b[i];
              T chunk = 0;
              for (int l = 0; l < kDotLanes; ++l) chunk += acc[l];
              sum += static_cast<double>(chunk);
            }
            partial[static_cast<std::size_t>(t)] = sum;
            break;
          }
          case MemOp::kMemcpy:
            if (hi > lo) std::memcpy(cc + lo, a + lo, (hi - lo) * sizeof(T));
            break;
          default: fail("{} needs a GPU", mem_op_name(c.op));
        }
      });
    };

    using clock = std::chrono::steady_clock;
    MemResult r;
    for (int w = 0; w < std::max(plan.warmup, 1); ++w) once();
    r.runs = static_cast<std::uint64_t>(std::max(plan.warmup, 1));
    // Small arrays: repeat the run inside a sample until it lasts min_sample_us.
    const auto t0 = clock::now();
    once();
    ++r.runs;
    const double one_us = std::chrono::duration<double, std::micro>(clock::now() - t0).count();
    r.batch = static_cast<int>(std::clamp(std::ceil(plan.min_sample_us / std::max(one_us, 1e-3)), 1.0, 100000.0));
    for (int it = 0; it < plan.iters; ++it) {
      const auto s0 = clock::now();
      for (int k = 0; k < r.batch; ++k) once();
      const double sec = std::chrono::duration<double>(clock::now() - s0).count();
      r.seconds.push_back(sec / r.batch);
      r.runs += static_cast<std::uint64_t>(r.batch);
    }

    if (c.op == MemOp::kDot) {
      r.dot = 0;
      for (double p : partial) r.dot += p;
      r.dot_chain = kDotChunk / kDotLanes + kDotLanes;
      if (plan.corrupt) r.dot *= 1.01;
    }
    if (plan.corrupt && c.op != MemOp::kDot) {
      const int out = c.op == MemOp::kMemcpy ? kArrayC : stream_output_array(static_cast<int>(c.op));
      T* o = out == kArrayA ? a : out == kArrayB ? b : cc;
      o[n / 2] = static_cast<T>(12288);
    }
    if (plan.check && c.op != MemOp::kDot) {
      const int kernel = c.op == MemOp::kMemcpy ? kKernelCopy : static_cast<int>(c.op);
      const int out = stream_output_array(kernel);
      verify_on_host(team_, kernel, out == kArrayA ? a : out == kArrayB ? b : cc, n, seed, r);
    }
    return r;
  }

  ThreadTeam team_;
};

}  // namespace

std::unique_ptr<MemBackend> make_cpu_mem_backend(int threads) { return std::make_unique<CpuMemBackend>(threads); }

}  // namespace keel::bench

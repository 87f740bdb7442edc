#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "bench/mem/backend.h"
#include "bench/mem/runner.h"
#include "common/error.h"

namespace keel::bench {
namespace {

MemPlan quick_plan(std::uint64_t seed) {
  MemPlan p;
  p.warmup = 2;
  p.iters = 3;
  p.min_sample_us = 0;
  p.seed = seed;
  return p;
}

}  // namespace

TEST(MemCpuBackend, EveryKernelVerifiesAtOddSizes) {
  auto backend = make_cpu_mem_backend(3);
  for (MemType t : {MemType::kF32, MemType::kF64})
    for (MemOp op : parse_mem_ops("stream"))
      for (std::uint64_t n : {1ull, 7ull, 1000ull, 65537ull}) {
        SCOPED_TRACE(fmt::format("{} {} n={}", mem_op_name(op), mem_type_name(t), n));
        MemResult r = backend->run({op, t, n, 0, 0}, quick_plan(n));
        EXPECT_EQ(r.seconds.size(), 3u);
        EXPECT_GE(r.runs, 5u);
        if (op == MemOp::kDot) {
          const double want = expected_dot(t, n, n);
          EXPECT_NEAR(r.dot, want, 1e-5 * want);
        } else {
          EXPECT_TRUE(r.checked);
          EXPECT_EQ(r.wrong, 0u) << r.first_wrong;
        }
      }
}

TEST(MemCpuBackend, CorruptionIsCaught) {
  auto backend = make_cpu_mem_backend(2);
  MemPlan p = quick_plan(4);
  p.corrupt = true;
  MemResult r = backend->run({MemOp::kTriad, MemType::kF32, 4096, 0, 0}, p);
  EXPECT_EQ(r.wrong, 1u);
  EXPECT_NE(r.first_wrong.find("element 2048"), std::string::npos) << r.first_wrong;
}

TEST(MemCpuBackend, RunnerChecksTheDotAndRanksAgainstTheBest) {
  auto backend = make_cpu_mem_backend(2);
  MemOptions o;
  o.ops = {MemOp::kDot, MemOp::kNstream};
  o.min_bytes = 4096;
  o.max_bytes = 65536;
  o.factor = 4;
  o.plan = quick_plan(1);
  MemReport rep = run_mem_bench(*backend, o, nullptr);
  ASSERT_EQ(rep.rows.size(), 6u);
  for (const auto& r : rep.rows) {
    EXPECT_TRUE(r.checked);
    EXPECT_EQ(r.wrong, 0u) << r.first_wrong;
    EXPECT_GT(r.gbps, 0);
    EXPECT_GT(r.pct_best, 0);
    EXPECT_LE(r.pct_best, 100.0 + 1e-9);
    EXPECT_EQ(r.pct_peak, -1);  // a CPU has no built-in spec
    EXPECT_NEAR(r.gbps, static_cast<double>(r.bytes) / (r.best_us * 1e3), 1e-9 * r.gbps);
  }
  o.plan.corrupt = true;
  MemReport bad = run_mem_bench(*backend, o, nullptr);
  EXPECT_EQ(bad.rows[0].wrong, 1u);  // dot off by 1%
  EXPECT_NE(bad.rows[0].first_wrong.find("expected"), std::string::npos);
}

TEST(MemCpuBackend, RefusesWhatItCannotRunOrFit) {
  auto backend = make_cpu_mem_backend(1);
  EXPECT_NE(backend->unsupported_reason(MemOp::kH2DPinned), "");
  EXPECT_EQ(backend->unsupported_reason(MemOp::kMemcpy), "");
  MemOptions o;
  o.ops = {MemOp::kPeerWrite, MemOp::kCopy};
  MemReport rep;
  resolve_mem_options(o, *backend, &rep);  // through a group: left out with a note
  EXPECT_EQ(o.ops, (std::vector<MemOp>{MemOp::kCopy}));
  ASSERT_EQ(rep.notes.size(), 1u);
  EXPECT_NE(rep.notes[0].find("peer_write"), std::string::npos);
  o.ops = {MemOp::kPeerWrite};
  o.named_ops = {MemOp::kPeerWrite};  // by name: an error
  EXPECT_THROW(resolve_mem_options(o, *backend, nullptr), UsageError);
  EXPECT_THROW(backend->check_fits({MemOp::kCopy, MemType::kF32, 1ull << 45, 0, 0}), Error);
}

TEST(MemCpuBackend, AGroupThatLeavesNothingToRunIsAnError) {
  // --op peer (or transfers) on CPUs: every op is left out; that used to run nothing and exit 0.
  auto backend = make_cpu_mem_backend(1);
  for (const char* group : {"peer", "transfers", "peer,transfers"}) {
    SCOPED_TRACE(group);
    MemOptions o;
    o.ops = parse_mem_ops(group);
    try {
      resolve_mem_options(o, *backend, nullptr);
      ADD_FAILURE() << "no error";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("needs a GPU: --backend cuda; nothing to run on the cpu backend"),
                std::string::npos)
          << e.what();
    }
  }
  MemOptions o;
  o.ops = parse_mem_ops("peer,copy");  // something left to run: a note, no error
  MemReport rep;
  resolve_mem_options(o, *backend, &rep);
  EXPECT_EQ(o.ops, (std::vector<MemOp>{MemOp::kCopy}));
}

TEST(MemCpuBackend, ThreadCountIsBounded) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(max_cpu_threads(), std::max(64, 4 * hw));
  EXPECT_LT(max_cpu_threads(), 30000);  // the auditor's count, which ran for minutes
}

}  // namespace keel::bench

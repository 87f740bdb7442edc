#include "bench/mem/runner.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "bench/mem/thread_team.h"
#include "bench/mem/values.h"
#include "common/error.h"
#include "common/units.h"
#include "hw/hardware.h"

namespace keel::bench {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// PCIe per direction: 5.0 x16 = 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s; 4.0 x16 half that.
double host_link_gbps(const hw::HardwareProfile& p) {
  if (p.name == "a100") return 31.5;
  return 63.0;  // h100, h200, b200, mi300x, mi325x: PCIe 5.0 x16
}

}  // namespace

int max_cpu_threads() { return std::max(64, 4 * static_cast<int>(std::thread::hardware_concurrency())); }

std::uint64_t default_min_bytes(const std::string& backend) { return backend == "cpu" ? 64ull << 10 : 256ull << 10; }
std::uint64_t default_max_bytes(const std::string& backend) { return backend == "cpu" ? 256ull << 20 : 2ull << 30; }

double mem_spec_gbps(MemOp op, const MemDevice& device, double override_gbps) {
  const hw::HardwareProfile* p = hw::match_device_name(device.name);
  if (is_stream_kernel(op) || op == MemOp::kMemcpy) {
    if (override_gbps > 0) return override_gbps;
    return p ? p->hbm_tbps * 1000.0 : 0;
  }
  if (!p) return 0;
  if (is_host_transfer(op)) return host_link_gbps(*p);
  return p->link_gbps * (is_bidirectional(op) ? 2 : 1);
}

void resolve_mem_options(MemOptions& o, const MemBackend& backend, MemReport* report) {
  try {
    if (o.min_bytes == 0) o.min_bytes = default_min_bytes(backend.name());
    if (o.max_bytes == 0) o.max_bytes = std::max(o.min_bytes, default_max_bytes(backend.name()));
    if (o.min_bytes > o.max_bytes)
      fail("--min ({}) is larger than --max ({})", format_size(o.min_bytes), format_size(o.max_bytes));
    if (o.min_bytes < mem_type_size(o.type))
      fail("--min {} is smaller than one {} element", format_size(o.min_bytes), mem_type_name(o.type));
    if (o.plan.iters < 1) fail("--iters must be at least 1");
    if (o.plan.warmup < 0) fail("--warmup must not be negative");
    (void)geometric_sizes(o.min_bytes, o.max_bytes, o.factor);
    std::vector<MemOp> all = o.ops;
    if (all.empty()) all = parse_mem_ops("all");
    o.ops.clear();
    std::vector<std::pair<std::string, std::string>> left_out;  // reason, ops
    for (MemOp op : all) {
      const std::string why = backend.unsupported_reason(op);
      if (why.empty()) {
        o.ops.push_back(op);
      } else if (std::find(o.named_ops.begin(), o.named_ops.end(), op) != o.named_ops.end()) {
        fail("--op {} {} (backend {})", mem_op_name(op), why, backend.name());
      } else {
        if (left_out.empty() || left_out.back().first != why) left_out.push_back({why, ""});
        left_out.back().second += (left_out.back().second.empty() ? "" : ", ") + std::string(mem_op_name(op));
      }
    }
    if (o.ops.empty()) {
      // Every op asked for was reached through a group this backend cannot run (--op peer on
      // CPUs): say so instead of running nothing and reporting success.
      std::string what;
      for (const auto& [why, ops] : left_out) what += fmt::format("{}{} {}", what.empty() ? "" : "; ", ops, why);
      fail("--op {}; nothing to run on the {} backend", what, backend.name());
    }
    if (report)
      for (const auto& [why, ops] : left_out) report->notes.push_back(fmt::format("left out ({}): {}", why, ops));
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

double expected_dot(MemType t, std::uint64_t seed, std::uint64_t n) {
  ThreadTeam team(static_cast<int>(std::max(1u, std::min(32u, std::thread::hardware_concurrency()))));
  std::vector<double> part(static_cast<std::size_t>(team.size()), 0.0);
  team.run([&](int m, int nm) {
    std::uint64_t lo, hi;
    ThreadTeam::slice(n, m, nm, &lo, &hi);
    double s = 0;
    for (std::uint64_t i = lo; i < hi; ++i)
      s += static_cast<double>(stream_input(seed, kArrayA, i)) * static_cast<double>(stream_input(seed, kArrayB, i));
    part[static_cast<std::size_t>(m)] = s;
  });
  (void)t;  // inputs are exact in fp32 and fp64 alike
  double sum = 0;
  for (double p : part) sum += p;
  return sum;
}

MemReport run_mem_bench(MemBackend& backend, MemOptions& o,
                        const std::function<void(const MemReport&, std::size_t)>& on_op) {
  MemReport report;
  report.backend = backend.name();
  report.devices = backend.devices();
  report.versions = backend.library_versions();
  resolve_mem_options(o, backend, &report);
  const auto sizes = geometric_sizes(o.min_bytes, o.max_bytes, o.factor);
  const std::size_t es = mem_type_size(o.type);

  // Fail before hours of sweeping if the largest size cannot fit.
  for (MemOp op : o.ops) {
    MemCase c{op, o.type, sizes.back() / es, 0, 0};
    if (is_peer(op)) c.dst = 1;
    else c.src = c.dst = o.device;
    backend.check_fits(c);
  }

  const MemDevice& measured = report.devices.front();
  std::uint64_t case_index = 0;
  for (MemOp op : o.ops) {
    const std::size_t first_row = report.rows.size();
    std::vector<std::pair<int, int>> pairs;
    if (is_peer(op)) {
      for (const auto& a : report.devices)
        for (const auto& b : report.devices)
          if (a.index != b.index) pairs.push_back({a.index, b.index});
      std::sort(pairs.begin(), pairs.end());
    } else {
      pairs.push_back({o.device, o.device});
    }
    for (std::uint64_t size : sizes) {
      for (auto [src, dst] : pairs) {
        MemCase c{op, o.type, size / es, src, dst};
        MemPlan plan = o.plan;
        plan.seed = keel::splitmix64(o.plan.seed * 1000003 + case_index++);  // fresh inputs for every case
        MemResult r = backend.run(c, plan);
        MemRow row;
        row.op = op;
        row.type = o.type;
        row.elements = c.elements;
        row.array_bytes = c.elements * es;
        row.bytes = bytes_moved(op, o.type, c.elements);
        row.src = src;
        row.dst = dst;
        row.batch = r.batch;
        row.samples = static_cast<int>(r.seconds.size());
        const double best = *std::min_element(r.seconds.begin(), r.seconds.end());
        const double med = median(r.seconds);
        row.best_us = best * 1e6;
        row.median_us = med * 1e6;
        row.gbps = static_cast<double>(row.bytes) / best / 1e9;
        row.gbps_median = static_cast<double>(row.bytes) / med / 1e9;
        const MemDevice* dev = &measured;
        for (const auto& d : report.devices)
          if (d.index == src) dev = &d;
        row.peak_gbps = mem_spec_gbps(op, *dev, o.peak_gbps);
        if (row.peak_gbps > 0) row.pct_peak = 100.0 * row.gbps / row.peak_gbps;
        row.p2p = r.p2p;
        row.launch = r.launch;
        row.checked = r.checked;
        row.wrong = r.wrong;
        row.first_wrong = r.first_wrong;
        if (op == MemOp::kDot && o.plan.check) {
          const double want = expected_dot(o.type, plan.seed, c.elements);
          const double eps = o.type == MemType::kF32 ? 0x1p-24 : 0x1p-53;
          const double tol = stream_dot_tolerance(want, r.dot_chain, c.elements, eps);
          row.checked = true;
          if (!(std::fabs(r.dot - want) <= tol)) {
            row.wrong = 1;
            row.first_wrong = fmt::format("dot = {:.12g}, expected {:.12g} (tolerance {:.3g})", r.dot, want, tol);
          }
        }
        report.rows.push_back(row);
      }
    }
    // % of the best this op reached anywhere in the sweep.
    double best = 0;
    for (std::size_t i = first_row; i < report.rows.size(); ++i) best = std::max(best, report.rows[i].gbps);
    for (std::size_t i = first_row; i < report.rows.size(); ++i)
      report.rows[i].pct_best = best > 0 ? 100.0 * report.rows[i].gbps / best : -1;
    if (on_op) on_op(report, first_row);
  }
  return report;
}

}  // namespace keel::bench

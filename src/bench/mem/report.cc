#include "bench/mem/report.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "bench/bench_json.h"
#include "common/error.h"
#include "common/fileio.h"
#include "common/plot.h"
#include "common/units.h"

namespace keel::bench {
namespace {

std::string describe(MemOp op, const std::string& backend) {
  const bool gpu = backend == "cuda";
  switch (op) {
    case MemOp::kCopy: return "c = a  (2 arrays per run)";
    case MemOp::kMul: return "b = s*c  (2 arrays per run)";
    case MemOp::kAdd: return "c = a + b  (3 arrays per run)";
    case MemOp::kTriad: return "a = b + s*c  (3 arrays per run)";
    case MemOp::kDot: return "sum a*b  (2 arrays per run)";
    case MemOp::kNstream: return "a += b + s*c  (4 arrays per run)";
    case MemOp::kMemcpy:
      return gpu ? "cudaMemcpyAsync device to device, copy engine  (read + write: 2 arrays per run)"
                 : "memcpy  (read + write: 2 arrays per run)";
    case MemOp::kH2DPinned: return "host (pinned) to device, copy engine";
    case MemOp::kH2DPageable: return "host (pageable) to device, copy engine";
    case MemOp::kD2HPinned: return "device to host (pinned), copy engine";
    case MemOp::kD2HPageable: return "device to host (pageable), copy engine";
    case MemOp::kPeerWrite: return "GPU to GPU, issued by the source (write), one direction";
    case MemOp::kPeerRead: return "GPU to GPU, issued by the destination (read), one direction";
    case MemOp::kPeerBidirWrite: return "GPU to GPU both ways at once, each issued by its source (sum of both)";
    case MemOp::kPeerBidirRead: return "GPU to GPU both ways at once, each issued by its destination (sum of both)";
  }
  return "";
}

std::string pct(double v) { return v < 0 ? fmt::format("{:>6}", "-") : fmt::format("{:6.1f}", v); }

nlohmann::json pct_json(double v) { return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v); }

std::string conv_bytes() {
  return "bytes read + bytes written per run, BabelStream's count: copy, mul, dot 2 arrays; add, triad 3; nstream "
         "4; memcpy 2 (nvbandwidth's device_local_copy counts 1); transfers count the bytes over the link, both "
         "directions summed for bidirectional ones";
}

}  // namespace

void print_mem_header(const MemReport& report, const MemOptions& o, std::FILE* out) {
  const MemDevice& d = report.devices.front();
  std::fprintf(out, "# keel bench mem  |  backend %s  |  %s  |  %s\n", report.backend.c_str(), d.name.c_str(),
               report.backend == "cuda"
                   ? fmt::format("{} SMs, {} L2, {} memory", d.sm_count, format_size(d.l2_bytes),
                                 format_size(d.memory_bytes)).c_str()
                   : fmt::format("{} threads, {} last-level cache", d.sm_count, format_size(d.l2_bytes)).c_str());
  for (const auto& [k, v] : report.versions) std::fprintf(out, "#   %s %s\n", k.c_str(), v.c_str());
  std::fprintf(out, "# bandwidth = (bytes read + bytes written) / best time, as BabelStream counts it; GB/s = 1e9 B/s\n");
  std::fprintf(out, "# %s, %d timed samples after %d warm-up runs; inputs random in [0.5, 1), every output %s\n",
               std::string(mem_type_name(o.type)).c_str(), o.plan.iters, o.plan.warmup,
               o.plan.check ? "element checked" : "unchecked (--no-check)");
  for (const auto& n : report.notes) std::fprintf(out, "# note: %s\n", n.c_str());
  std::fflush(out);
}

void print_mem_block(const MemReport& report, const MemOptions& o, std::size_t first_row, std::FILE* out) {
  if (first_row >= report.rows.size()) return;
  const MemRow& r0 = report.rows[first_row];
  const bool peer = is_peer(r0.op);
  std::fprintf(out, "#\n# %s  %s  |  %s  |  peak %s\n", std::string(mem_op_name(r0.op)).c_str(),
               std::string(mem_type_name(r0.type)).c_str(), describe(r0.op, report.backend).c_str(),
               r0.peak_gbps > 0 ? fmt::format("{:.0f} GB/s", r0.peak_gbps).c_str() : "unknown (--peak-gbps)");
  std::fprintf(out, "# %s%12s %12s %6s %10s %10s %9s %9s %6s %6s %7s\n", peer ? "src dst " : "", "array", "moved/run",
               "batch", "best(us)", "med(us)", "GB/s", "GB/s-med", "%peak", "%best", "#wrong");
  for (std::size_t i = first_row; i < report.rows.size(); ++i) {
    const MemRow& r = report.rows[i];
    const std::string pair = peer ? fmt::format("{:3d} {:3d} ", r.src, r.dst) : "";
    std::fprintf(out, "  %s%12s %12s %6d %10.2f %10.2f %9.1f %9.1f %s %s %7s%s%s\n", pair.c_str(),
                 format_size(r.array_bytes).c_str(), format_size(r.bytes).c_str(), r.batch, r.best_us, r.median_us,
                 r.gbps, r.gbps_median, pct(r.pct_peak).c_str(), pct(r.pct_best).c_str(),
                 r.checked ? std::to_string(r.wrong).c_str() : "-", peer && !r.p2p ? "  (no P2P: staged via host)" : "",
                 r.launch.empty() ? "" : ("  " + r.launch).c_str());
    if (r.wrong)
      std::fprintf(stderr, "keel: error: %s %s at %s: %llu wrong values, first: %s\n",
                   std::string(mem_op_name(r.op)).c_str(), std::string(mem_type_name(r.type)).c_str(),
                   format_size(r.array_bytes).c_str(), static_cast<unsigned long long>(r.wrong), r.first_wrong.c_str());
  }
  if (peer) {
    // nvbandwidth's layout: source rows, destination columns, at the largest size.
    std::uint64_t largest = 0;
    int n = 0;
    for (std::size_t i = first_row; i < report.rows.size(); ++i) {
      largest = std::max(largest, report.rows[i].array_bytes);
      n = std::max({n, report.rows[i].src + 1, report.rows[i].dst + 1});
    }
    std::fprintf(out, "# %s GB/s at %s (rows: source GPU, columns: destination GPU)\n#      ",
                 std::string(mem_op_name(r0.op)).c_str(), format_size(largest).c_str());
    for (int j = 0; j < n; ++j) std::fprintf(out, " %8d", j);
    std::fprintf(out, "\n");
    for (int s = 0; s < n; ++s) {
      std::fprintf(out, "#  %3d ", s);
      for (int d = 0; d < n; ++d) {
        double v = -1;
        for (std::size_t i = first_row; i < report.rows.size(); ++i) {
          const MemRow& r = report.rows[i];
          if (r.array_bytes == largest && r.src == s && r.dst == d) v = r.gbps;
        }
        if (v < 0) std::fprintf(out, " %8s", "-");
        else std::fprintf(out, " %8.1f", v);
      }
      std::fprintf(out, "\n");
    }
  }
  (void)o;
  std::fflush(out);
}

std::uint64_t print_mem_summary(const MemReport& report, const MemOptions& o, std::FILE* out) {
  std::uint64_t wrong = 0;
  for (const auto& r : report.rows) wrong += r.wrong;
  std::fprintf(out, "#\n# Wrong values: %llu %s\n", static_cast<unsigned long long>(wrong),
               !o.plan.check ? "(not checked: --no-check)" : wrong ? "FAILED" : "OK");
  return wrong;
}

void write_mem_json(const MemReport& report, const MemOptions& o, const std::string& path) {
  nlohmann::json args = {{"backend", report.backend},
                         {"dtype", mem_type_name(o.type)},
                         {"min_bytes", o.min_bytes},
                         {"max_bytes", o.max_bytes},
                         {"factor", o.factor},
                         {"warmup", o.plan.warmup},
                         {"iters", o.plan.iters},
                         {"min_sample_us", o.plan.min_sample_us},
                         {"device", o.device},
                         {"check", o.plan.check},
                         {"seed", o.plan.seed},
                         {"peak_gbps", o.peak_gbps}};
  for (MemOp op : o.ops) args["ops"].push_back(mem_op_name(op));
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : report.devices)
    devices.push_back({{"index", d.index},
                       {"name", d.name},
                       {"sm_count", d.sm_count},
                       {"l2_bytes", d.l2_bytes},
                       {"memory_bytes", d.memory_bytes},
                       {"bus_id", d.bus_id}});
  nlohmann::json results = nlohmann::json::array();
  std::uint64_t wrong = 0;
  for (const auto& r : report.rows) {
    wrong += r.wrong;
    nlohmann::json j = {{"kernel", mem_op_name(r.op)},
                        {"category", is_stream_kernel(r.op) ? "kernel" : r.op == MemOp::kMemcpy ? "copy_engine"
                                                         : is_host_transfer(r.op)         ? "host_transfer"
                                                                                          : "peer"},
                        {"dtype", mem_type_name(r.type)},
                        {"array_bytes", r.array_bytes},
                        {"elements", r.elements},
                        {"bytes", r.bytes},
                        {"src", r.src},
                        {"dst", r.dst},
                        {"batch", r.batch},
                        {"samples", r.samples},
                        {"best_us", r.best_us},
                        {"median_us", r.median_us},
                        {"gbps", r.gbps},
                        {"gbps_median", r.gbps_median},
                        {"peak_gbps", r.peak_gbps > 0 ? nlohmann::json(r.peak_gbps) : nlohmann::json(nullptr)},
                        {"pct_peak", pct_json(r.pct_peak)},
                        {"pct_best", pct_json(r.pct_best)},
                        {"checked", r.checked},
                        {"wrong", r.wrong}};
    if (is_peer(r.op)) j["p2p"] = r.p2p;
    if (!r.launch.empty()) j["launch"] = r.launch;
    if (!r.first_wrong.empty()) j["first_wrong"] = r.first_wrong;
    results.push_back(j);
  }
  nlohmann::json doc = bench_json_header(kMemJsonSchema, "bench mem", args, report.backend, devices, report.versions);
  doc.update(nlohmann::json{
      {"conventions",
       {{"bytes", conv_bytes()},
        {"array_bytes", "bytes of one array (the swept size)"},
        {"best_us", "fastest sample's time per run; a sample is `batch` back-to-back runs (a CUDA graph on GPUs) "
                    "between device events (host clock on CPUs)"},
        {"median_us", "median over samples of the time per run"},
        {"gbps", "bytes / best_us, 1e9 bytes per second (BabelStream reports the best time)"},
        {"gbps_median", "bytes / median_us"},
        {"pct_peak", "gbps / peak_gbps x 100: HBM spec for kernels and memcpy, PCIe per direction for host "
                     "transfers, NVLink per direction (x2 for bidirectional) for peer ops; null when unknown"},
        {"pct_best", "gbps / the highest gbps of the same kernel in this run x 100"},
        {"wrong", "output elements off their analytic value (dot: 1 if the sum is off)"}}},
      {"notes", report.notes},
      {"results", results},
      {"wrong_values", wrong},
  });
  write_file_atomically(path, doc.dump(2) + "\n");
}

void write_mem_csv(const MemReport& report, const std::string& path) {
  std::string text =
      "kernel,dtype,array_bytes,elements,bytes,src,dst,batch,samples,best_us,median_us,gbps,gbps_median,peak_gbps,"
      "pct_peak,pct_best,wrong\n";
  auto opt = [](double v) { return v < 0 ? std::string() : fmt::format("{:.2f}", v); };
  for (const auto& r : report.rows)
    text += fmt::format("{},{},{},{},{},{},{},{},{},{:.3f},{:.3f},{:.3f},{:.3f},{},{},{},{}\n", mem_op_name(r.op),
                        mem_type_name(r.type), r.array_bytes, r.elements, r.bytes, r.src, r.dst, r.batch, r.samples,
                        r.best_us, r.median_us, r.gbps, r.gbps_median, r.peak_gbps > 0 ? opt(r.peak_gbps) : "",
                        opt(r.pct_peak), opt(r.pct_best), r.wrong);
  write_file_atomically(path, text);
}

std::vector<std::string> write_mem_plots(const MemReport& report, const std::string& path) {
  // chart -> op -> (array size -> sum, count) so peer ops plot the mean over GPU pairs.
  std::map<int, std::map<int, std::map<std::uint64_t, std::pair<double, int>>>> charts;
  for (const auto& r : report.rows) {
    const int chart = is_stream_kernel(r.op) || r.op == MemOp::kMemcpy ? 0 : is_host_transfer(r.op) ? 1 : 2;
    auto& cell = charts[chart][static_cast<int>(r.op)][r.array_bytes];
    cell.first += r.gbps;
    cell.second += 1;
  }
  static const char* kSuffix[] = {"kernels", "transfers", "peer"};
  static const char* kTitle[] = {"kernels and device copy", "host <-> device transfers", "GPU <-> GPU (mean over pairs)"};
  const std::filesystem::path base(path);
  std::vector<std::string> written;
  for (auto& [chart_id, ops] : charts) {
    plot::Chart chart;
    const MemDevice& d = report.devices.front();
    chart.title = fmt::format("keel bench mem: {} on {} ({})", kTitle[chart_id], d.name, report.backend);
    chart.x_label = "array size";
    chart.y_label = "bandwidth (GB/s, bytes read + written / best time)";
    chart.log_x = true;
    chart.x_format = plot::AxisFormat::kBytes;
    chart.y_from_zero = true;
    for (auto& [op, points] : ops) {
      plot::Series s;
      s.label = std::string(mem_op_name(static_cast<MemOp>(op)));
      for (auto& [size, acc] : points) {
        s.x.push_back(static_cast<double>(size));
        s.y.push_back(acc.first / acc.second);
      }
      chart.series.push_back(std::move(s));
    }
    std::string file = path;
    if (charts.size() > 1)
      file = (base.parent_path() / (base.stem().string() + "_" + kSuffix[chart_id] + base.extension().string())).string();
    plot::write_png(chart, file);
    written.push_back(file);
  }
  return written;
}

}  // namespace keel::bench

#include "bench/comm/report.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "bench/bench_json.h"
#include "common/error.h"
#include "common/fileio.h"
#include "common/plot.h"
#include "common/units.h"


namespace keel::bench {
namespace {

std::string fmt_time(double us) { return us < 1e5 ? fmt::format("{:9.2f}", us) : fmt::format("{:9.0f}", us); }

std::string placement_cells(const PlacementResult& p, bool applicable) {
  if (!applicable || !p.measured) return fmt::format("{:>9} {:>8} {:>8} {:>9} {:>9} {:>4} {:>7}", "n/a", "", "", "", "", "", "");
  return fmt::format("{} {:8.2f} {:8.2f} {} {} {:4d} {:7d}", fmt_time(p.time_us), p.algbw, p.busbw, fmt_time(p.iter_p50_us),
                     fmt_time(p.iter_p99_us), p.slowest_rank, p.wrong);
}

const char* placement_name(Placement p) {
  return p == Placement::kBoth ? "both" : p == Placement::kInPlace ? "in" : "out";
}

nlohmann::json placement_json(const PlacementResult& p) {
  if (!p.measured) return nullptr;
  nlohmann::json j = {{"time_us", p.time_us},         {"algbw_gbps", p.algbw},
                      {"busbw_gbps", p.busbw},        {"iter_p50_us", p.iter_p50_us},
                      {"iter_p99_us", p.iter_p99_us}, {"slowest_rank", p.slowest_rank},
                      {"slowest_rank_us", p.slowest_rank_us}, {"wrong", p.wrong}};
  if (!p.first_wrong.empty()) j["first_wrong"] = p.first_wrong;
  return j;
}

}  // namespace

void TablePrinter::begin_block(const ResultRow& r) {
  std::string what = fmt::format("{}  {}", collective_name(r.op), dtype_name(r.dtype));
  if (r.reduces) what += fmt::format("  {}", redop_name(r.redop));
  if (r.op == Collective::kBroadcast) what += fmt::format("  root {}", o_.root);
  const std::string timing =
      o_.plan.graph_replays > 0
          ? fmt::format("CUDA graph of {} ops replayed {}x", o_.plan.iters, o_.plan.graph_replays)
          : fmt::format("host-timed loop of {} ops", o_.plan.iters);
  std::fprintf(out_, "#\n# %s  |  %d ranks%s  |  %s, %d warm-up\n", what.c_str(), r.nranks,
               r.ngroups > 1 ? fmt::format(", {} groups at once", r.ngroups).c_str() : "", timing.c_str(), o_.plan.warmup);
  const char* g = r.ngroups > 1 ? "grp " : "";
  const char* gp = r.ngroups > 1 ? "    " : "";
  // Each placement block is 60 columns wide (the cells of placement_cells()).
  std::fprintf(out_, "# %s%12s %12s  %s  %s\n", gp, "", "", fmt::format("{:-^60}", " out-of-place ").c_str(),
               fmt::format("{:-^60}", " in-place ").c_str());
  std::fprintf(out_, "# %s%12s %12s  %9s %8s %8s %9s %9s %4s %7s  %9s %8s %8s %9s %9s %4s %7s\n", g, "size", "count", "time",
               "algbw", "busbw", "iter-p50", "iter-p99", "slow", "#wrong", "time", "algbw", "busbw", "iter-p50", "iter-p99",
               "slow", "#wrong");
  std::fprintf(out_, "# %s%12s %12s  %9s %8s %8s %9s %9s %4s %7s  %9s %8s %8s %9s %9s %4s %7s\n", gp, "(B)", "(elements)",
               "(us)", "(GB/s)", "(GB/s)", "(us)", "(us)", "rank", "", "(us)", "(GB/s)", "(GB/s)", "(us)", "(us)", "rank", "");
  std::fflush(out_);
}

void TablePrinter::row(const ResultRow& r) {
  const std::string g = r.ngroups > 1 ? fmt::format("{:3d} ", r.group) : "";
  std::fprintf(out_, "  %s%12llu %12llu  %s  %s\n", g.c_str(), static_cast<unsigned long long>(r.size_bytes),
               static_cast<unsigned long long>(r.count),
               placement_cells(r.out_of_place, o_.placement != Placement::kInPlace).c_str(),
               placement_cells(r.in_place, o_.placement != Placement::kOutOfPlace && collective_has_in_place(r.op)).c_str());
  for (const PlacementResult* p : {&r.out_of_place, &r.in_place}) {
    if (p->wrong == 0) continue;
    std::fprintf(stderr, "keel: error: %s %s %s on %d ranks (%s): %llu wrong values, first at %s\n",
                 collective_name(r.op).data(), dtype_name(r.dtype).data(), format_size(r.size_bytes).c_str(), r.nranks,
                 p == &r.in_place ? "in-place" : "out-of-place", static_cast<unsigned long long>(p->wrong),
                 p->first_wrong.c_str());
  }
  std::fflush(out_);
}

std::uint64_t print_summary(const CommReport& report, const CommOptions& o, std::FILE* out) {
  std::uint64_t wrong = 0;
  for (const auto& r : report.rows) wrong += r.out_of_place.wrong + r.in_place.wrong;
  std::fprintf(out, "#\n# Wrong values: %llu %s\n", static_cast<unsigned long long>(wrong),
               !o.check ? "(not checked: --no-check)" : wrong ? "FAILED" : "OK");
  std::fprintf(out, "# busbw = algbw x 2(n-1)/n all_reduce; x (n-1)/n all_gather, reduce_scatter, all_to_all; x 1 "
                    "broadcast, send_recv (nccl-tests)\n");
  return wrong;
}

void write_json(const CommReport& report, const CommOptions& o, const std::string& path) {
  nlohmann::json args = {
      {"backend", o.backend},
      {"placement", placement_name(o.placement)},
      {"min_bytes", o.min_bytes},
      {"max_bytes", o.max_bytes},
      {"factor", o.factor},
      {"ranks", o.ranks.empty() ? std::vector<int>{report.world_size} : o.ranks},
      {"all_groups", o.all_groups},
      {"root", o.root},
      {"warmup", o.plan.warmup},
      {"iters", o.plan.iters},
      {"graph_replays", o.plan.graph_replays},
      {"timeout_s", o.plan.timeout_s},
      {"check", o.check},
      {"seed", o.seed},
      {"min_busbw_gbps", o.min_busbw},
  };
  for (auto op : o.ops) args["ops"].push_back(collective_name(op));
  for (auto t : o.dtypes) args["dtypes"].push_back(dtype_name(t));
  for (auto r : o.redops) args["redops"].push_back(redop_name(r));

  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : report.devices)
    devices.push_back({{"rank", d.rank}, {"host", d.host}, {"name", d.name}, {"bus_id", d.bus_id}, {"device", d.device}});

  nlohmann::json results = nlohmann::json::array();
  std::uint64_t wrong = 0;
  for (const auto& r : report.rows) {
    wrong += r.out_of_place.wrong + r.in_place.wrong;
    results.push_back({{"op", collective_name(r.op)},
                       {"dtype", dtype_name(r.dtype)},
                       {"redop", r.reduces ? nlohmann::json(redop_name(r.redop)) : nlohmann::json(nullptr)},
                       {"ranks", r.nranks},
                       {"group", r.group},
                       {"groups", r.ngroups},
                       {"size_bytes", r.size_bytes},
                       {"count", r.count},
                       {"out_of_place", placement_json(r.out_of_place)},
                       {"in_place", placement_json(r.in_place)}});
  }
  nlohmann::json doc = bench_json_header(kCommJsonSchema, "bench comm", args, report.backend, devices, report.versions);
  doc.update(nlohmann::json{
      {"world_size", report.world_size},
      {"conventions",
       {{"size", "bytes of the larger of the send and receive buffers, per rank (nccl-tests)"},
        {"time_us", o.plan.graph_replays > 0 ? "CUDA-graph replay: elapsed / (replays x ops), averaged over ranks"
                                             : "host-timed loop: elapsed / ops, averaged over ranks (nccl-tests default)"},
        {"algbw_gbps", "size / time, 1e9 bytes per second"},
        {"busbw_gbps", "algbw x 2(n-1)/n all_reduce; x (n-1)/n all_gather, reduce_scatter, all_to_all; x 1 broadcast, "
                       "send_recv"},
        {"iter_p50_us", "median over iterations of the slowest rank's time for that iteration"},
        {"iter_p99_us", "99th percentile (nearest rank) of the same"},
        {"slowest_rank", "the rank with the largest mean per-iteration time"}}},
      {"results", results},
      {"wrong_values", wrong},
  });
  write_file_atomically(path, doc.dump(2) + "\n");
}

void write_csv(const CommReport& report, const std::string& path) {
  std::string text =
      "op,dtype,redop,ranks,group,groups,size_bytes,count,placement,time_us,algbw_gbps,busbw_gbps,iter_p50_us,"
      "iter_p99_us,slowest_rank,slowest_rank_us,wrong\n";
  for (const auto& r : report.rows) {
    for (int k = 0; k < 2; ++k) {
      const PlacementResult& p = k == 0 ? r.out_of_place : r.in_place;
      if (!p.measured) continue;
      text += fmt::format("{},{},{},{},{},{},{},{},{},{:.3f},{:.4f},{:.4f},{:.3f},{:.3f},{},{:.3f},{}\n",
                          collective_name(r.op), dtype_name(r.dtype), r.reduces ? redop_name(r.redop) : "",
                          r.nranks, r.group, r.ngroups, r.size_bytes, r.count, k == 0 ? "out" : "in", p.time_us,
                          p.algbw, p.busbw, p.iter_p50_us, p.iter_p99_us, p.slowest_rank, p.slowest_rank_us, p.wrong);
    }
  }
  write_file_atomically(path, text);
}

std::vector<std::string> write_plots(const CommReport& report, const std::string& path) {
  // One chart per (op, dtype, redop, placement); one series per (ranks, group).
  using ChartKey = std::tuple<int, int, int, int>;
  std::map<ChartKey, std::map<std::pair<int, int>, plot::Series>> charts;
  for (const auto& r : report.rows) {
    for (int k = 0; k < 2; ++k) {
      const PlacementResult& p = k == 0 ? r.out_of_place : r.in_place;
      if (!p.measured) continue;
      auto& series = charts[{static_cast<int>(r.op), static_cast<int>(r.dtype), r.reduces ? static_cast<int>(r.redop) : -1, k}]
                           [{r.nranks, r.group}];
      if (series.label.empty())
        series.label = r.ngroups > 1 ? fmt::format("{} ranks (group {} of {})", r.nranks, r.group, r.ngroups)
                                     : fmt::format("{} ranks", r.nranks);
      series.x.push_back(static_cast<double>(r.size_bytes));
      series.y.push_back(p.busbw);
    }
  }
  std::vector<std::string> written;
  const std::filesystem::path base(path);
  for (auto& [key, series] : charts) {
    const auto [op, dtype, redop, k] = key;
    const std::string what = fmt::format("{} {}{}{}", collective_name(static_cast<Collective>(op)),
                                         dtype_name(static_cast<DType>(dtype)),
                                         redop >= 0 ? fmt::format(" {}", redop_name(static_cast<RedOp>(redop))) : "",
                                         k == 1 ? " in-place" : "");
    plot::Chart chart;
    chart.title = fmt::format("keel bench comm: {} ({})", what, report.backend);
    chart.x_label = "message size";
    chart.y_label = "busbw (GB/s)";
    chart.log_x = true;
    chart.x_format = plot::AxisFormat::kBytes;
    for (auto& [_, s] : series) chart.series.push_back(s);
    std::string file = path;
    if (charts.size() > 1) {
      std::string suffix = what;
      std::replace(suffix.begin(), suffix.end(), ' ', '_');
      file = (base.parent_path() / (base.stem().string() + "_" + suffix + base.extension().string())).string();
    }
    plot::write_png(chart, file);
    written.push_back(file);
  }
  return written;
}

namespace {

namespace fs = std::filesystem;

// The directory a file at `path` lands in.
fs::path directory_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// Creates and removes a file beside `path`, as write_file_atomically's temporary will be: the
// same directory, the same permissions. An existing file at `path` is left untouched.
void probe_directory(std::string_view flag, const std::string& path) {
  const fs::path dir = directory_of(path);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("{} '{}': directory '{}' does not exist", flag, path, dir.string());
  const std::string why = why_no_new_file(path + ".keel-probe." + std::to_string(::getpid()));
  if (!why.empty())
    fail("{} '{}' cannot be written: no new file can be made in '{}': {}", flag, path, dir.string(), why);
}

// A file that --json or --csv will replace: it must not be a directory or a device.
void check_result_file(std::string_view flag, const std::string& path) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (fs::is_directory(status)) fail("{} '{}' is a directory; name a file", flag, path);
  if (fs::exists(status) && !fs::is_regular_file(status)) fail("{} '{}' is not a regular file", flag, path);
  probe_directory(flag, path);
}

// Two flags naming one file would silently overwrite one result with the other.
std::string identity_of(const std::string& path) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return ec ? path : canonical.string();
}

}  // namespace

void check_output_paths(const CommOptions& o) {
  std::vector<std::pair<std::string_view, const std::string*>> named;
  if (!o.json_path.empty()) {
    check_result_file("--json", o.json_path);
    named.emplace_back("--json", &o.json_path);
  }
  if (!o.csv_path.empty()) {
    check_result_file("--csv", o.csv_path);
    named.emplace_back("--csv", &o.csv_path);
  }
  if (!o.plot_path.empty()) {
    // A prefix: the plots are written beside it as <stem>_<op>_<dtype>...<ext>.
    std::error_code ec;
    if (fs::is_directory(o.plot_path, ec))
      fail("--plot '{}' is a directory; name a file such as '{}'", o.plot_path,
           (fs::path(o.plot_path) / "comm.png").string());
    probe_directory("--plot", o.plot_path);
    named.emplace_back("--plot", &o.plot_path);
  }
  for (size_t i = 0; i < named.size(); ++i)
    for (size_t j = i + 1; j < named.size(); ++j)
      if (identity_of(*named[i].second) == identity_of(*named[j].second))
        fail("{} and {} both name '{}': one would overwrite the other", named[i].first, named[j].first,
             *named[j].second);
}

std::vector<std::string> busbw_gate_failures(const CommReport& report, double min_busbw) {
  std::vector<std::string> misses;
  if (min_busbw == 0) return misses;  // the gate is off (NaN is not 0: it fails every series)
  // The largest size of each series is the row that decides.
  std::map<std::tuple<int, int, int, int, int, int>, const ResultRow*> last;
  for (const auto& r : report.rows) {
    for (int k = 0; k < 2; ++k) {
      const PlacementResult& p = k == 0 ? r.out_of_place : r.in_place;
      if (!p.measured) continue;
      auto& slot = last[{static_cast<int>(r.op), static_cast<int>(r.dtype), static_cast<int>(r.redop), r.nranks, r.group, k}];
      if (!slot || r.size_bytes > slot->size_bytes) slot = &r;
    }
  }
  for (const auto& [key, r] : last) {
    const int k = std::get<5>(key);
    const PlacementResult& p = k == 0 ? r->out_of_place : r->in_place;
    if (!(p.busbw >= min_busbw))  // a NaN on either side is a miss, never a silent pass
      misses.push_back(fmt::format("{} {} at {} on {} ranks{} ({}): busbw {:.2f} GB/s is below --min-busbw {:g}",
                                   collective_name(r->op), dtype_name(r->dtype), format_size(r->size_bytes), r->nranks,
                                   r->ngroups > 1 ? fmt::format(" group {}", r->group) : "",
                                   k == 0 ? "out-of-place" : "in-place", p.busbw, min_busbw));
  }
  return misses;
}

}  // namespace keel::bench

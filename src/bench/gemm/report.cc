#include "bench/gemm/report.h"

#include <algorithm>
#include <array>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "bench/bench_json.h"
#include "common/error.h"
#include "common/fileio.h"
#include "common/plot.h"
#include "common/units.h"

namespace keel::bench {
namespace {

std::string label(const GemmRow& r) {
  if (r.shape.name.empty()) return "";
  return r.shape.name;
}

std::string check_cell(const GemmRow& r) {
  if (!r.checked) return "-";
  if (r.wrong || r.nonfinite) return fmt::format("{}/{} WRONG", r.wrong, r.samples);
  return fmt::format("{}/{} ok", r.samples - r.wrong, r.samples);
}

std::string tiles_cell(const GemmRow& r) {
  if (r.tiles.ctas == 0) return fmt::format("{:>9} {:>10} {:>6}", "-", "-", "-");
  return fmt::format("{:>9} {:>10} {:5.1f}%", fmt::format("{}x{}", r.algo.tile_m, r.algo.tile_n),
                     fmt::format("{:.2f}/{}", r.tiles.waves, r.tiles.full_waves), 100.0 * r.tiles.tile_waste);
}

std::string tflops_cell(double v) {
  return v >= 100 ? fmt::format("{:8.1f}", v) : v >= 1 ? fmt::format("{:8.2f}", v) : fmt::format("{:8.4f}", v);
}

std::string source_cell(const GemmRow& r) {
  if (r.algo.source == "autotuned")
    return fmt::format("tuned {}/{}", r.algo.chosen_rank + 1, r.algo.candidates);
  return r.algo.source;
}

}  // namespace

void print_gemm_header(const GemmBackend& backend, const GemmOptions& o, std::FILE* out) {
  const GemmDevice d = backend.device();
  std::fprintf(out, "# keel bench gemm  |  backend %s  |  %s  |  %s\n", backend.name().c_str(), d.name.c_str(),
               d.compute_capability.empty()
                   ? fmt::format("{} threads, {} last-level cache", d.sm_count, format_size(d.l2_bytes)).c_str()
                   : fmt::format("sm_{}, {} SMs, {} L2", std::string(d.compute_capability).erase(1, 1), d.sm_count,
                                 format_size(d.l2_bytes)).c_str());
  for (const auto& [k, v] : backend.library_versions()) std::fprintf(out, "#   %s %s\n", k.c_str(), v.c_str());
  std::string dtypes;
  for (auto t : o.dtypes) {
    if (!dtypes.empty()) dtypes += ",";
    dtypes += gemm_type_name(t);
  }
  std::fprintf(out, "# C[m x n] = op(A) op(B) row-major, batch independent GEMMs; TFLOP/s = 2mnk*batch / median time of "
                    "%d runs after %d warm-up, operands rotated so L2 holds none of them\n",
               o.plan.iters, o.plan.warmup);
  if (backend.name() == "cublaslt")
    std::fprintf(out, "# %s; algorithm: %s; workspace %s; waves = tiles / %d SMs; tile waste = computed outside C\n",
                 dtypes.c_str(),
                 o.plan.candidates > 1 ? fmt::format("fastest of cuBLASLt's top {} heuristic candidates", o.plan.candidates).c_str()
                                       : "cuBLASLt's first heuristic choice",
                 format_size(o.plan.workspace).c_str(), d.sm_count);
  if (o.mode == "model")
    std::fprintf(out, "# layer GEMMs of %s at %lld tokens per step (fwd X W^T: nt; bwd_data dY W: nn; bwd_weight X^T dY: tn)\n",
                 o.model.c_str(), static_cast<long long>(o.tokens));
  for (const auto& n : o.notes) std::fprintf(out, "# note: %s\n", n.c_str());
  std::fprintf(out, "#\n# %-15s %-10s %7s %7s %7s %5s %3s %5s %8s %6s %10s %9s %10s %6s  %-11s %-10s %s\n", "name", "pass",
               "m", "n", "k", "batch", "lay", "type", "TFLOP/s", "%peak", "median(us)", "tile", "waves", "waste",
               "algo", "check", "algorithm");
  std::fflush(out);
}

void print_gemm_row(const GemmRow& r, std::FILE* out) {
  const auto& s = r.shape;
  if (!r.skipped.empty()) {
    std::fprintf(out, "  %-15s %-10s %7lld %7lld %7lld %5lld %3s %5s  skipped: %s\n", label(r).c_str(), s.pass.c_str(),
                 static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k),
                 static_cast<long long>(s.batch), std::string(layout_name(s.layout)).c_str(),
                 std::string(gemm_type_name(r.type)).c_str(), r.skipped.c_str());
    std::fflush(out);
    return;
  }
  std::fprintf(out, "  %-15s %-10s %7lld %7lld %7lld %5lld %3s %5s %s %6s %10.2f %s  %-11s %-10s %s\n",
               label(r).c_str(), s.pass.c_str(), static_cast<long long>(s.m), static_cast<long long>(s.n),
               static_cast<long long>(s.k), static_cast<long long>(s.batch), std::string(layout_name(s.layout)).c_str(),
               std::string(gemm_type_name(r.type)).c_str(), tflops_cell(r.tflops).c_str(),
               r.pct_peak < 0 ? "-" : fmt::format("{:.1f}", r.pct_peak).c_str(), r.median_us, tiles_cell(r).c_str(),
               source_cell(r).c_str(), check_cell(r).c_str(), r.algo.description.c_str());
  if (r.wrong)
    std::fprintf(stderr, "keel: error: %lldx%lldx%lld %s: %d of %d sampled outputs wrong, first at %s\n",
                 static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k),
                 std::string(gemm_type_name(r.type)).c_str(), r.wrong, r.samples, r.first_wrong.c_str());
  if (r.nonfinite)
    std::fprintf(stderr, "keel: error: %lldx%lldx%lld %s: %llu output elements are NaN or inf (unwritten?)\n",
                 static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k),
                 std::string(gemm_type_name(r.type)).c_str(), static_cast<unsigned long long>(r.nonfinite));
  std::fflush(out);
}

std::uint64_t gemm_failures(const GemmReport& report) {
  std::uint64_t bad = 0;
  for (const auto& r : report.rows) bad += static_cast<std::uint64_t>(r.wrong) + (r.nonfinite ? 1 : 0);
  return bad;
}

std::uint64_t print_gemm_summary(const GemmReport& report, const GemmOptions& o, std::FILE* out) {
  if (o.mode == "model") {
    // One occurrence of each GEMM, and the whole model's step (each GEMM x the layers running it).
    std::map<GemmType, std::array<double, 4>> tot;  // flops, us, model flops, model us
    for (const auto& r : report.rows) {
      if (!r.skipped.empty()) continue;
      auto& t = tot[r.type];
      t[0] += r.flops;
      t[1] += r.median_us;
      t[2] += r.flops * static_cast<double>(r.shape.layers);
      t[3] += r.median_us * static_cast<double>(r.shape.layers);
    }
    for (const auto& [type, t] : tot)
      std::fprintf(out,
                   "#\n# %s: one of each GEMM %.3f ms, %.1f TFLOP/s; whole model (GEMMs x layers) %.2f ms per step "
                   "of %lld tokens, %.1f TFLOP/s\n",
                   std::string(gemm_type_name(type)).c_str(), t[1] / 1e3, t[0] / (t[1] * 1e-6) / 1e12, t[3] / 1e3,
                   static_cast<long long>(o.tokens), t[2] / (t[3] * 1e-6) / 1e12);
  }
  std::uint64_t samples = 0, wrong = 0, nonfinite_rows = 0;
  for (const auto& r : report.rows) {
    samples += static_cast<std::uint64_t>(r.samples);
    wrong += static_cast<std::uint64_t>(r.wrong);
    nonfinite_rows += r.nonfinite ? 1 : 0;
  }
  std::fprintf(out, "#\n# Check: %llu sampled outputs against a double-precision host dot product, %llu wrong; %llu GEMMs "
                    "left NaN/inf in their output: %s\n",
               static_cast<unsigned long long>(samples), static_cast<unsigned long long>(wrong),
               static_cast<unsigned long long>(nonfinite_rows),
               !o.plan.check ? "not checked (--no-check)" : (wrong || nonfinite_rows) ? "FAILED" : "OK");
  return wrong + nonfinite_rows;
}

void write_gemm_json(const GemmReport& report, const GemmOptions& o, const std::string& path) {
  nlohmann::json args = {{"backend", report.backend},
                         {"mode", o.mode},
                         {"warmup", o.plan.warmup},
                         {"iters", o.plan.iters},
                         {"candidates", o.plan.candidates},
                         {"tune_iters", o.plan.tune_iters},
                         {"workspace_bytes", o.plan.workspace},
                         {"rotate_bytes", o.plan.rotate_bytes},
                         {"check", o.plan.check},
                         {"check_samples", o.plan.check_samples},
                         {"seed", o.plan.seed},
                         {"tune_cache", o.plan.tune_cache},
                         {"device", o.device},
                         {"peak_tflops", o.peak_tflops}};
  for (auto t : o.dtypes) args["dtypes"].push_back(gemm_type_name(t));
  if (o.mode == "model") {
    args["model"] = o.model;
    args["tokens"] = o.tokens;
  }
  const GemmDevice& d = report.device;
  nlohmann::json devices = nlohmann::json::array();
  devices.push_back({{"index", o.device},
                     {"name", d.name},
                     {"sm_count", d.sm_count},
                     {"l2_bytes", d.l2_bytes},
                     {"memory_bytes", d.memory_bytes},
                     {"compute_capability", d.compute_capability}});
  nlohmann::json results = nlohmann::json::array();
  for (const auto& r : report.rows) {
    const auto& s = r.shape;
    nlohmann::json j = {{"name", s.name},   {"pass", s.pass},   {"m", s.m},
                        {"n", s.n},         {"k", s.k},         {"batch", s.batch},
                        {"layers", s.layers}, {"layout", layout_name(s.layout)}, {"dtype", gemm_type_name(r.type)},
                        {"flops", r.flops}};
    if (!r.skipped.empty()) {
      j["skipped"] = r.skipped;
      j["tflops"] = nullptr;
      results.push_back(j);
      continue;
    }
    j.update({{"median_us", r.median_us},
              {"min_us", r.min_us},
              {"mean_us", r.mean_us},
              {"tflops", r.tflops},
              {"tflops_best", r.tflops_best},
              {"peak_tflops", r.peak_tflops > 0 ? nlohmann::json(r.peak_tflops) : nlohmann::json(nullptr)},
              {"pct_peak", r.pct_peak < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.pct_peak)},
              {"algo",
               {{"source", r.algo.source},
                {"description", r.algo.description},
                {"tile_m", r.algo.tile_m},
                {"tile_n", r.algo.tile_n},
                {"split_k", r.algo.split_k},
                {"cluster_m", r.algo.cluster_m},
                {"cluster_n", r.algo.cluster_n},
                {"lt_waves", r.algo.lt_waves < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.algo.lt_waves)},
                {"candidates", r.algo.candidates},
                {"chosen_rank", r.algo.chosen_rank},
                {"first_choice_us", r.algo.first_choice_us > 0 ? nlohmann::json(r.algo.first_choice_us)
                                                                : nlohmann::json(nullptr)},
                {"workspace_bytes", r.algo.workspace}}},
              {"ctas", r.tiles.ctas},
              {"waves", r.tiles.ctas ? nlohmann::json(r.tiles.waves) : nlohmann::json(nullptr)},
              {"full_waves", r.tiles.ctas ? nlohmann::json(r.tiles.full_waves) : nlohmann::json(nullptr)},
              {"wave_efficiency", r.tiles.ctas ? nlohmann::json(r.tiles.wave_efficiency) : nlohmann::json(nullptr)},
              {"tile_waste", r.tiles.ctas ? nlohmann::json(r.tiles.tile_waste) : nlohmann::json(nullptr)},
              {"rotating_sets", r.rotating_sets},
              {"checked", r.checked},
              {"check_samples", r.samples},
              {"wrong", r.wrong},
              {"nonfinite", r.nonfinite},
              {"worst_error_ratio", r.worst_ratio}});
    if (!r.first_wrong.empty()) j["first_wrong"] = r.first_wrong;
    results.push_back(j);
  }
  nlohmann::json doc = bench_json_header(kGemmJsonSchema, "bench gemm", args, report.backend, devices, report.versions);
  doc.update(nlohmann::json{
      {"conventions",
       {{"gemm", "row-major C[m x n] = op(A) op(B), batch independent GEMMs; layout: A then B, n = stored as used "
                 "([m x k], [k x n]), t = stored transposed"},
        {"flops", "2 m n k batch"},
        {"tflops", "flops / median time, 1e12 per second; tflops_best uses the fastest run"},
        {"median_us", "median over timed runs, each between two device events (host clock on CPUs), all runs queued "
                      "behind a spin kernel so host launch gaps do not count; operand sets rotate so each run reads "
                      "operands that are not in L2"},
        {"pct_peak", "tflops / the device's dense spec peak for the dtype x 100 (null when unknown)"},
        {"tile", "output tile along m x along n of the chosen kernel"},
        {"waves", "ctas / SMs with ctas = ceil(m/tile_m) ceil(n/tile_n) batch splitK; full_waves = ceil(waves)"},
        {"tile_waste", "1 - m n / (tiles_m tile_m tiles_n tile_n): share of computed output outside C"},
        {"check", "sampled outputs against a double-precision dot product of the operands as stored, on fresh "
                  "inputs with the output poisoned (NaN) first; nonfinite counts outputs left NaN/inf"}}},
      {"notes", o.notes},
      {"results", results},
      {"check_failures", gemm_failures(report)},
  });
  write_file_atomically(path, doc.dump(2) + "\n");
}

void write_gemm_csv(const GemmReport& report, const std::string& path) {
  std::string text =
      "name,pass,m,n,k,batch,layers,layout,dtype,flops,median_us,min_us,tflops,tflops_best,pct_peak,algo_source,"
      "tile_m,tile_n,split_k,ctas,waves,full_waves,tile_waste,rotating_sets,check_samples,wrong,nonfinite,skipped\n";
  for (const auto& r : report.rows) {
    const auto& s = r.shape;
    text += fmt::format("{},{},{},{},{},{},{},{},{},{:.0f},{:.3f},{:.3f},{:.3f},{:.3f},{},{},{},{},{},{},{:.4f},{},{:.4f},{},{},{},{},{}\n",
                        s.name, s.pass, s.m, s.n, s.k, s.batch, s.layers, layout_name(s.layout), gemm_type_name(r.type),
                        r.flops, r.median_us, r.min_us, r.tflops, r.tflops_best,
                        r.pct_peak < 0 ? "" : fmt::format("{:.2f}", r.pct_peak), r.algo.source, r.algo.tile_m,
                        r.algo.tile_n, r.algo.split_k, r.tiles.ctas, r.tiles.waves, r.tiles.full_waves,
                        r.tiles.tile_waste, r.rotating_sets, r.samples, r.wrong, r.nonfinite,
                        r.skipped.empty() ? "" : "\"" + r.skipped + "\"");
  }
  write_file_atomically(path, text);
}

std::vector<std::string> write_gemm_plots(const GemmReport& report, const GemmOptions& o, const std::string& path) {
  // The x dimension: asked for, or the one with the most distinct values.
  std::set<std::int64_t> ms, ns, ks;
  for (const auto& r : report.rows) ms.insert(r.shape.m), ns.insert(r.shape.n), ks.insert(r.shape.k);
  std::string x = o.plot_x;
  if (x == "auto") {
    const std::size_t best = std::max({ms.size(), ns.size(), ks.size()});
    x = best <= 1 || o.mode == "model" ? "gflop" : ms.size() == best ? "m" : ns.size() == best ? "n" : "k";
  }
  std::map<std::string, plot::Series> series;
  for (const auto& r : report.rows) {
    if (!r.skipped.empty()) continue;
    const auto& s = r.shape;
    std::string key = fmt::format("{} {}", gemm_type_name(r.type), layout_name(s.layout));
    if (x == "m") key += fmt::format(" n={} k={}", s.n, s.k);
    if (x == "n") key += fmt::format(" m={} k={}", s.m, s.k);
    if (x == "k") key += fmt::format(" m={} n={}", s.m, s.n);
    if (s.batch > 1 && x != "gflop") key += fmt::format(" batch={}", s.batch);
    auto& ser = series[key];
    ser.label = key;
    ser.x.push_back(x == "m" ? s.m : x == "n" ? s.n : x == "k" ? s.k : r.flops / 1e9);
    ser.y.push_back(r.tflops);
  }
  if (series.empty()) return {};
  plot::Chart chart;
  chart.title = fmt::format("keel bench gemm: {} ({})", report.device.name, report.backend);
  chart.x_label = x == "gflop" ? "GFLOP per GEMM" : x;
  chart.y_label = "TFLOP/s (median)";
  chart.log_x = x == "gflop";
  chart.y_from_zero = true;
  for (auto& [_, s] : series) {
    // Sorted by x so the sawtooth reads left to right.
    std::vector<std::size_t> idx(s.x.size());
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return s.x[a] < s.x[b]; });
    plot::Series sorted;
    sorted.label = s.label;
    for (auto i : idx) sorted.x.push_back(s.x[i]), sorted.y.push_back(s.y[i]);
    chart.series.push_back(std::move(sorted));
  }
  plot::write_png(chart, path);
  return {path};
}

}  // namespace keel::bench

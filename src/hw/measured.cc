#include "hw/measured.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "common/fileio.h"
#include "common/units.h"

namespace keel::hw {
namespace {

std::string known_names() {
  std::string s;
  for (const auto& p : builtin_profiles()) s += (s.empty() ? "" : ", ") + p.name;
  return s;
}

double number(const nlohmann::json& row, const char* key, const std::string& file) {
  const auto it = row.find(key);
  if (it == row.end() || !it->is_number())
    throw UsageError(fmt::format("{}: a result row has no numeric '{}'", file, key));
  return it->get<double>();
}

// What a real measurement can be: a value outside these ranges is a broken or hand-edited file,
// and taken as is would print "link -3 GB/s" or "inf days". The bounds are far outside any
// device (H200: ~480 GB/s busbw, 4.8 TB/s HBM, ~1000 dense TFLOP/s, 132 SMs).
struct Range {
  double lo, hi;
  const char* unit;
};
constexpr Range kBandwidthGbps{1e-6, 1e6, "GB/s"};  // 1 kB/s .. 1 PB/s
constexpr Range kTflops{1e-6, 1e5, "TFLOP/s"};      // 1 MFLOP/s .. 100 PFLOP/s
constexpr double kMaxSmCount = 65536;               // SMs/CUs, or CPU threads in a CPU-backend file
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53: above it a double skips integers

// `row[key]` as a measurement within `range`; the error names the file, the field and the value.
double measured(const nlohmann::json& row, const char* key, const std::string& field, const std::string& file,
                const Range& range) {
  const double v = number(row, key, file);
  if (!(std::isfinite(v) && v >= range.lo && v <= range.hi))
    throw UsageError(fmt::format("{}: {} must be a measurement in [{:g}, {:g}] {} (got {})", file, field, range.lo,
                                 range.hi, range.unit, v));
  return v;
}

// `row[key]` as a whole number in [lo, hi] (a double that is integral counts: JSON writers differ).
std::int64_t whole(const nlohmann::json& row, const char* key, const std::string& field, const std::string& file,
                   double lo, double hi) {
  const auto it = row.find(key);
  if (it == row.end() || !it->is_number()) throw UsageError(fmt::format("{}: {} is missing or not a number", file, field));
  const double v = it->get<double>();
  if (!(std::isfinite(v) && v == std::floor(v) && v >= lo && v <= hi))
    throw UsageError(fmt::format("{}: {} must be a whole number in [{:g}, {:g}] (got {})", file, field, lo, hi,
                                 it->dump()));
  return static_cast<std::int64_t>(v);
}

void apply_comm(Hardware& hw, const nlohmann::json& j, const std::string& file) {
  // The all_reduce row with the most ranks and then the largest size: the bandwidth a
  // gradient all-reduce over the node sees (nccl-tests busbw convention).
  const nlohmann::json* best = nullptr;
  int best_ranks = 0;
  double best_size = 0;
  for (const auto& r : j.at("results")) {
    if (!r.contains("op") || r["op"] != "all_reduce") continue;
    const auto oop = r.find("out_of_place");
    if (oop == r.end() || oop->is_null() || !oop->contains("busbw_gbps")) continue;
    const int ranks = static_cast<int>(whole(r, "ranks", "an all_reduce row's 'ranks'", file, 1, 1 << 30));
    const double size = static_cast<double>(
        whole(r, "size_bytes", "an all_reduce row's 'size_bytes'", file, 0, kMaxExactInteger));
    if (!best || ranks > best_ranks || (ranks == best_ranks && size > best_size)) {
      best = &r;
      best_ranks = ranks;
      best_size = size;
    }
  }
  if (!best) throw UsageError(fmt::format("{}: no all_reduce results with out_of_place.busbw_gbps", file));
  hw.measured_busbw_gbps = measured((*best)["out_of_place"], "busbw_gbps", "out_of_place.busbw_gbps", file, kBandwidthGbps);
  hw.measured_busbw_ranks = best_ranks;
  hw.profile.link_gbps = hw.measured_busbw_gbps;
  hw.sources.push_back(fmt::format("{}: all_reduce busbw {:.1f} GB/s at {} ranks, {}", file, hw.measured_busbw_gbps,
                                   best_ranks, format_size(static_cast<std::uint64_t>(best_size))));
}

void apply_mem(Hardware& hw, const nlohmann::json& j, const std::string& file) {
  double best = 0;
  std::string kernel;
  for (const auto& r : j.at("results")) {
    const double g = measured(r, "gbps", "'gbps'", file, kBandwidthGbps);
    if (g > best) best = g, kernel = r.value("kernel", std::string("?"));
  }
  if (best <= 0) throw UsageError(fmt::format("{}: no results with 'gbps'", file));
  hw.measured_hbm_tbps = best / 1000;
  hw.profile.hbm_tbps = hw.measured_hbm_tbps;
  hw.sources.push_back(fmt::format("{}: HBM {:.2f} TB/s measured ({})", file, hw.measured_hbm_tbps, kernel));
}

void apply_gemm(Hardware& hw, const nlohmann::json& j, const std::string& file) {
  std::size_t n = 0, skipped = 0;
  double best = 0;
  for (const auto& r : j.at("results")) {
    // A row keel bench gemm skipped (e.g. out of memory) carries its reason and no tflops.
    if (r.contains("skipped")) {
      ++skipped;
      continue;
    }
    const std::string row = fmt::format("results[{}]", n + skipped);
    GemmSample s;
    s.shape.m = whole(r, "m", row + ".m", file, 1, kMaxExactInteger);
    s.shape.n = whole(r, "n", row + ".n", file, 1, kMaxExactInteger);
    s.shape.k = whole(r, "k", row + ".k", file, 1, kMaxExactInteger);
    s.shape.batch = r.contains("batch") ? whole(r, "batch", row + ".batch", file, 1, kMaxExactInteger) : 1;
    s.tflops = measured(r, "tflops", row + ".tflops", file, kTflops);
    if (!r.contains("dtype") || !r["dtype"].is_string())
      throw UsageError(fmt::format("{}: a result row has no string 'dtype'", file));
    s.dtype = r["dtype"].get<std::string>();
    if (s.dtype == "bf16") best = std::max(best, s.tflops);
    hw.gemm_profile.push_back(s);
    ++n;
  }
  if (n == 0) throw UsageError(fmt::format("{}: no GEMM results", file));
  hw.sources.push_back(fmt::format("{}: GEMM profile, {} shapes{}, best bf16 {:.1f} TFLOP/s", file, n,
                                   skipped ? fmt::format(" ({} skipped rows left out)", skipped) : std::string(), best));
}

// devices[0]: picks the base profile when none was named, and supplies the SM count.
void apply_device(Hardware& hw, bool& have_base, const nlohmann::json& j, const std::string& file) {
  if (!j.contains("devices") || !j["devices"].is_array() || j["devices"].empty()) {
    if (!have_base)
      throw UsageError(fmt::format("{}: no devices[] to pick a base profile from; name one first, e.g. "
                                   "--hardware h100,{}",
                                   file, file));
    return;
  }
  const auto& d = j["devices"][0];
  const std::string name = d.value("name", std::string());
  if (!have_base) {
    const HardwareProfile* p = match_device_name(name);
    if (!p)
      throw UsageError(fmt::format("{}: device '{}' matches no built-in profile; name one first, e.g. "
                                   "--hardware h100,{}",
                                   file, name, file));
    hw.spec = hw.profile = *p;
    have_base = true;
    hw.sources.push_back(fmt::format("built-in {} (device '{}' in {})", p->name, name, file));
  }
  if (d.contains("sm_count"))
    hw.profile.sm_count = static_cast<int>(whole(d, "sm_count", "devices[0].sm_count", file, 1, kMaxSmCount));
}

// One keel bench JSON file, by its schema.
void apply_file(Hardware& hw, bool& have_base, const nlohmann::json& j, const std::string& file) {
  if (!j.is_object() || !j.contains("schema") || !j["schema"].is_string())
    throw UsageError(fmt::format("{}: no 'schema' field: not a keel bench JSON", file));
  const std::string schema = j["schema"];
  if (!j.contains("results") || !j["results"].is_array()) throw UsageError(fmt::format("{}: no 'results' array", file));
  apply_device(hw, have_base, j, file);
  if (schema == "keel.bench.comm/1") apply_comm(hw, j, file);
  else if (schema == "keel.bench.mem/1") apply_mem(hw, j, file);
  else if (schema == "keel.bench.gemm/1") apply_gemm(hw, j, file);
  else
    throw UsageError(fmt::format("{}: unsupported schema '{}' (keel.bench.comm/1, keel.bench.gemm/1 or "
                                 "keel.bench.mem/1)",
                                 file, schema));
}

}  // namespace

Hardware load_hardware(const std::string& spec) {
  Hardware hw;
  bool have_base = false;
  std::vector<std::pair<std::string, nlohmann::json>> files;
  for (const std::string& part : split_list(spec)) {
    const bool is_json = part.size() > 5 && part.compare(part.size() - 5, 5, ".json") == 0;
    if (!is_json) {
      const HardwareProfile* p = find_profile(part);
      if (!p) throw UsageError(fmt::format("unknown hardware '{}' (built-in: {}; or a keel bench JSON file)", part, known_names()));
      if (have_base) throw UsageError(fmt::format("--hardware names two base profiles ('{}' and '{}')", hw.spec.name, part));
      hw.spec = hw.profile = *p;
      have_base = true;
      hw.sources.push_back("built-in " + p->name + " (" + p->description + ")");
      continue;
    }
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_config_file(part));
    } catch (const nlohmann::json::exception& e) {
      throw UsageError(fmt::format("{}: not valid JSON ({})", part, e.what()));
    } catch (const Error& e) {
      throw UsageError(e.what());
    }
    files.emplace_back(part, std::move(j));
  }
  if (files.empty() && !have_base) throw UsageError("--hardware is empty");

  for (auto& [file, j] : files) {
    try {
      apply_file(hw, have_base, j, file);
    } catch (const nlohmann::json::exception& e) {
      throw UsageError(fmt::format("{}: unexpected layout ({})", file, e.what()));
    }
  }
  return hw;
}

}  // namespace keel::hw

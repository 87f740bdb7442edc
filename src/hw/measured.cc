#include "hw/measured.h"

#include <nlohmann/json.hpp>

#include <algorithm>

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
    const int ranks = static_cast<int>(number(r, "ranks", file));
    const double size = number(r, "size_bytes", file);
    if (!best || ranks > best_ranks || (ranks == best_ranks && size > best_size)) {
      best = &r;
      best_ranks = ranks;
      best_size = size;
    }
  }
  if (!best) throw UsageError(fmt::format("{}: no all_reduce results with out_of_place.busbw_gbps", file));
  hw.measured_busbw_gbps = (*best)["out_of_place"]["busbw_gbps"].get<double>();
  hw.measured_busbw_ranks = best_ranks;
  hw.profile.link_gbps = hw.measured_busbw_gbps;
  hw.sources.push_back(fmt::format("{}: all_reduce busbw {:.1f} GB/s at {} ranks, {}", file, hw.measured_busbw_gbps,
                                   best_ranks, format_size(static_cast<std::uint64_t>(best_size))));
}

void apply_mem(Hardware& hw, const nlohmann::json& j, const std::string& file) {
  double best = 0;
  std::string kernel;
  for (const auto& r : j.at("results")) {
    const double g = number(r, "gbps", file);
    if (g > best) best = g, kernel = r.value("kernel", std::string("?"));
  }
  if (best <= 0) throw UsageError(fmt::format("{}: no positive 'gbps' in results", file));
  hw.measured_hbm_tbps = best / 1000;
  hw.profile.hbm_tbps = hw.measured_hbm_tbps;
  hw.sources.push_back(fmt::format("{}: HBM {:.2f} TB/s measured ({})", file, hw.measured_hbm_tbps, kernel));
}

void apply_gemm(Hardware& hw, const nlohmann::json& j, const std::string& file) {
  std::size_t n = 0;
  double best = 0;
  for (const auto& r : j.at("results")) {
    GemmSample s;
    s.shape.m = static_cast<std::int64_t>(number(r, "m", file));
    s.shape.n = static_cast<std::int64_t>(number(r, "n", file));
    s.shape.k = static_cast<std::int64_t>(number(r, "k", file));
    s.shape.batch = r.contains("batch") && r["batch"].is_number() ? r["batch"].get<std::int64_t>() : 1;
    s.tflops = number(r, "tflops", file);
    if (!r.contains("dtype") || !r["dtype"].is_string())
      throw UsageError(fmt::format("{}: a result row has no string 'dtype'", file));
    s.dtype = r["dtype"].get<std::string>();
    if (s.shape.m <= 0 || s.shape.n <= 0 || s.shape.k <= 0 || s.shape.batch <= 0) continue;
    if (s.dtype == "bf16") best = std::max(best, s.tflops);
    hw.gemm_profile.push_back(s);
    ++n;
  }
  if (n == 0) throw UsageError(fmt::format("{}: no GEMM results", file));
  hw.sources.push_back(fmt::format("{}: GEMM profile, {} shapes, best bf16 {:.1f} TFLOP/s", file, n, best));
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
      j = nlohmann::json::parse(read_file(part));
    } catch (const nlohmann::json::exception& e) {
      throw UsageError(fmt::format("{}: not valid JSON ({})", part, e.what()));
    } catch (const Error& e) {
      throw UsageError(e.what());
    }
    files.emplace_back(part, std::move(j));
  }
  if (files.empty() && !have_base) throw UsageError("--hardware is empty");

  for (auto& [file, j] : files) {
    if (!j.is_object() || !j.contains("schema") || !j["schema"].is_string())
      throw UsageError(fmt::format("{}: no 'schema' field: not a keel bench JSON", file));
    const std::string schema = j["schema"];
    if (!j.contains("results") || !j["results"].is_array())
      throw UsageError(fmt::format("{}: no 'results' array", file));
    // The device: picks the base profile when none was named, and supplies the SM count.
    if (j.contains("devices") && j["devices"].is_array() && !j["devices"].empty()) {
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
      if (d.contains("sm_count") && d["sm_count"].is_number_integer() && d["sm_count"].get<int>() > 0)
        hw.profile.sm_count = d["sm_count"].get<int>();
    } else if (!have_base) {
      throw UsageError(fmt::format("{}: no devices[] to pick a base profile from; name one first, e.g. "
                                   "--hardware h100,{}",
                                   file, file));
    }
    try {
      if (schema == "keel.bench.comm/1") apply_comm(hw, j, file);
      else if (schema == "keel.bench.mem/1") apply_mem(hw, j, file);
      else if (schema == "keel.bench.gemm/1") apply_gemm(hw, j, file);
      else throw UsageError(fmt::format("{}: unsupported schema '{}' (keel.bench.comm/1, keel.bench.gemm/1 or "
                                        "keel.bench.mem/1)", file, schema));
    } catch (const nlohmann::json::exception& e) {
      throw UsageError(fmt::format("{}: unexpected layout ({})", file, e.what()));
    }
  }
  return hw;
}

}  // namespace keel::hw

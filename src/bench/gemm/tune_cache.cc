#include "bench/gemm/tune_cache.h"

#include <fmt/format.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/fileio.h"

namespace keel::bench {
namespace {

constexpr const char* kSchema = "keel.gemm_tune/1";

std::string to_hex(const std::vector<std::uint8_t>& bytes) {
  std::string s;
  for (auto b : bytes) s += fmt::format("{:02x}", b);
  return s;
}

std::vector<std::uint8_t> from_hex(const std::string& s, const std::string& path) {
  if (s.size() % 2) fail("tune cache {}: algorithm bytes '{}' are not hex", path, s);
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i < s.size(); i += 2) {
    const int v = std::stoi(s.substr(i, 2), nullptr, 16);
    out.push_back(static_cast<std::uint8_t>(v));
  }
  return out;
}

std::map<std::string, TunedAlgo> load(const std::string& path) {
  std::map<std::string, TunedAlgo> out;
  if (path.empty() || !std::filesystem::exists(path)) return out;
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("tune cache {} is not valid JSON ({}); delete it or pass --tune-cache none", path, e.what());
  }
  if (doc.value("schema", "") != kSchema)
    fail("tune cache {} has schema '{}', expected {}", path, doc.value("schema", ""), kSchema);
  try {
    for (const auto& [key, e] : doc.at("entries").items()) {
      TunedAlgo t;
      t.algo = from_hex(e.at("algo").get<std::string>(), path);
      t.description = e.value("description", "");
      t.us = e.value("us", 0.0);
      t.tuned_at = e.value("tuned_at", "");
      out[key] = t;
    }
  } catch (const nlohmann::json::exception& e) {
    fail("tune cache {} is malformed ({}); delete it or pass --tune-cache none", path, e.what());
  }
  return out;
}

}  // namespace

std::string tune_key(const std::string& device, int sm_count, const std::string& library_version,
                     const std::string& dtype, const std::string& layout, std::int64_t m, std::int64_t n,
                     std::int64_t k, std::int64_t batch, std::uint64_t workspace) {
  return fmt::format("{}|sm{}|{}|{}|{}|{}x{}x{}x{}|ws{}", device, sm_count, library_version, dtype, layout, m, n, k,
                     batch, workspace);
}

std::string default_tune_cache_path() {
  if (const char* p = std::getenv("KEEL_GEMM_TUNE_CACHE"); p && *p) return p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/keel/gemm_tune.json";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/keel/gemm_tune.json";
  return "";
}

TuneCache::TuneCache(std::string path) : path_(std::move(path)) { entries_ = load(path_); }

std::optional<TunedAlgo> TuneCache::find(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

void TuneCache::put(const std::string& key, TunedAlgo algo) {
  if (algo.tuned_at.empty()) {
    const std::time_t now = std::time(nullptr);
    char buf[32];
    std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    algo.tuned_at = buf;
  }
  entries_[key] = algo;
  added_[key] = std::move(algo);
}

void TuneCache::save() {
  if (!enabled() || added_.empty()) return;
  auto merged = load(path_);
  for (const auto& [k, v] : added_) merged[k] = v;
  nlohmann::json entries = nlohmann::json::object();
  for (const auto& [k, v] : merged)
    entries[k] = {{"algo", to_hex(v.algo)}, {"description", v.description}, {"us", v.us}, {"tuned_at", v.tuned_at}};
  const nlohmann::json doc = {{"schema", kSchema}, {"entries", entries}};
  const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
  std::error_code ec;
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  if (ec) fail("tune cache: cannot create {}: {}", dir.string(), ec.message());
  write_file_atomically(path_, doc.dump(2) + "\n");
  added_.clear();
}

}  // namespace keel::bench

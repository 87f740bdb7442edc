// `keel size` output: the text report and the keel.size/1 JSON document.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "size/estimate.h"
#include "size/moe_study.h"
#include "size/rules.h"

namespace keel::size {

inline constexpr const char* kSizeJsonSchema = "keel.size/1";

struct SizeReport {
  std::string config_path;
  Setup setup;
  model::ParamCounts params;
  model::TokenFlops flops;
  MemoryEstimate memory;
  DecodeState decode;
  std::vector<DecodePoint> decode_points;
  StepEstimate step;
  TrainTime train;
  std::vector<Finding> findings;
  std::optional<MoeStudy> moe;
};

SizeReport build_report(const std::string& config_path, const Setup& s, const MoeStudyOptions* moe);
void print_report(const SizeReport& r, std::FILE* out, bool show_gemms);
nlohmann::json report_json(const SizeReport& r);

// "8.30B", "753.7M", "12.6K"; decimal.
std::string human_count(double x);
// "1.23 GiB"
std::string human_bytes(double b);
// "12.3 days", "4.5 h"
std::string human_duration(double seconds);

}  // namespace keel::size

#include "train/config_changes.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <map>
#include <utility>

#include "ckpt/metadata.h"
#include "train/train_config.h"

namespace keel::train {

namespace {

// The scalars of a YAML document under dotted names ("optimizer.lr" -> "3.0e-3"; list items by index).
void flatten_yaml(const YAML::Node& n, const std::string& key, std::map<std::string, std::string>& out) {
  if (n.IsMap()) {
    if (n.size() == 0 && !key.empty()) out[key] = "{}";
    for (const auto& kv : n) {
      const std::string k = kv.first.Scalar();
      flatten_yaml(kv.second, key.empty() ? k : key + "." + k, out);
    }
  } else if (n.IsSequence()) {
    if (n.size() == 0) out[key] = "[]";
    for (std::size_t i = 0; i < n.size(); ++i) flatten_yaml(n[i], fmt::format("{}[{}]", key, i), out);
  } else if (n.IsScalar()) {
    out[key] = n.Scalar();
  } else {
    out[key] = "null";
  }
}

bool same_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  char *ea = nullptr, *eb = nullptr;
  const double x = std::strtod(a.c_str(), &ea), y = std::strtod(b.c_str(), &eb);
  return !a.empty() && !b.empty() && *ea == 0 && *eb == 0 && x == y;  // 3.0e-3 and 0.003
}

}  // namespace

std::string config_changes(const std::string& saved, const std::string& now, const std::string& prefix) {
  std::map<std::string, std::string> a, b;
  try {
    flatten_yaml(YAML::Load(saved), "", a);
    flatten_yaml(YAML::Load(now), "", b);
  } catch (const std::exception&) {
    return "";
  }
  std::map<std::string, std::pair<std::string, std::string>> keys;
  for (const auto& [k, v] : a) keys[k].first = v;
  for (const auto& [k, v] : b) keys[k].second = v;
  std::string out;
  for (const auto& [k, v] : keys) {
    if (!k.starts_with(prefix)) continue;
    const bool in_a = a.contains(k), in_b = b.contains(k);
    if (in_a && in_b && same_value(v.first, v.second)) continue;
    out += fmt::format("{}{} {} -> {}", out.empty() ? "" : ", ", k, in_a ? v.first : "(unset)",
                       in_b ? v.second : "(unset)");
  }
  return out;
}

std::string recorded_model_changes(const std::string& dir, const model::ModelConfig& model) {
  model::ModelConfig saved;
  try {
    const ckpt::Metadata m = ckpt::read_metadata(dir);
    if (!m.state.is_object() || !m.state.contains("config") || !m.state["config"].is_string()) return "";
    saved = parse_train_config(m.state["config"].get<std::string>(), dir).model;
  } catch (const std::exception&) {
    return "";
  }
  const auto a = model::model_key_values(saved), b = model::model_key_values(model);
  std::string out;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].second != b[i].second)
      out += fmt::format("{}{} {} -> {}", out.empty() ? "" : ", ", a[i].first, a[i].second, b[i].second);
  return out;
}

}  // namespace keel::train

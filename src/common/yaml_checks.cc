#include "common/yaml_checks.h"

#include <fmt/format.h>

#include <map>

#include "common/error.h"

namespace keel {
namespace {

void check(const YAML::Node& node, const std::string& prefix, const std::string& what) {
  if (node.IsSequence()) {
    for (std::size_t i = 0; i < node.size(); ++i) check(node[i], fmt::format("{}[{}]", prefix, i), what);
    return;
  }
  if (!node.IsMap()) return;
  std::map<std::string, YAML::Mark> seen;
  for (const auto& kv : node) {
    // keys that are not scalars (rare, `? [a, b]`) cannot collide with the names keel reads
    if (!kv.first.IsScalar()) continue;
    const std::string key = kv.first.Scalar();
    const std::string full = prefix.empty() ? key : prefix + "." + key;
    const auto [it, fresh] = seen.emplace(key, kv.first.Mark());
    if (!fresh) {
      const int a = it->second.line + 1, b = kv.first.Mark().line + 1;
      throw UsageError(a > 0 && b > 0 ? fmt::format("{}: key '{}' appears twice (lines {} and {})", what, full, a, b)
                                      : fmt::format("{}: key '{}' appears twice", what, full));
    }
    check(kv.second, full, what);
  }
}

}  // namespace

void reject_duplicate_keys(const YAML::Node& node, const std::string& what) { check(node, "", what); }

std::string yaml_line_suffix(const YAML::Node& node) {
  const int line = node.Mark().line;
  return line >= 0 ? fmt::format(" (line {})", line + 1) : "";
}

}  // namespace keel

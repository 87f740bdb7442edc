#include "common/yaml_checks.h"

#include <fmt/format.h>

#include <map>

#include "common/error.h"

namespace keel {
namespace {

struct Walk {
  std::string what;
  bool check_utf8 = false;
  std::size_t nodes = 0;

  void count() {
    if (++nodes > kMaxYamlNodes)
      throw UsageError(fmt::format("{}: more than {} values with its aliases expanded (aliases nested inside "
                                   "aliases?); a keel config holds a few hundred",
                                   what, kMaxYamlNodes));
  }
  // `text` is the value of `key`, or with `its_name` the key's own name
  void utf8(const std::string& text, const std::string& key, const YAML::Node& at, bool its_name) {
    if (!check_utf8) return;
    const std::string why = why_not_utf8(text);
    if (why.empty()) return;
    const std::string name = key.empty() ? "the document"
                                         : fmt::format("{}key '{}'", its_name ? "the name of " : "", escape_bytes(key));
    throw UsageError(fmt::format("{}: {}{} is not valid UTF-8 ({}); configs are stored in checkpoints as JSON, "
                                 "which needs UTF-8",
                                 what, name, yaml_line_suffix(at), why));
  }

  void check(const YAML::Node& node, const std::string& prefix) {
    count();
    if (node.IsScalar()) {
      utf8(node.Scalar(), prefix, node, false);
      return;
    }
    if (node.IsSequence()) {
      for (std::size_t i = 0; i < node.size(); ++i) check(node[i], fmt::format("{}[{}]", prefix, i));
      return;
    }
    if (!node.IsMap()) return;
    std::map<std::string, YAML::Mark> seen;
    for (const auto& kv : node) {
      // keys that are not scalars (rare, `? [a, b]`) cannot collide with the names keel reads
      if (!kv.first.IsScalar()) {
        check(kv.first, prefix + ".?");
        check(kv.second, prefix + ".?");
        continue;
      }
      count();
      const std::string key = kv.first.Scalar();
      const std::string full = prefix.empty() ? key : prefix + "." + key;
      utf8(key, full, kv.first, true);
      const auto [it, fresh] = seen.emplace(key, kv.first.Mark());
      if (!fresh) {
        const int a = it->second.line + 1, b = kv.first.Mark().line + 1;
        throw UsageError(a > 0 && b > 0 ? fmt::format("{}: key '{}' appears twice (lines {} and {})", what, full, a, b)
                                        : fmt::format("{}: key '{}' appears twice", what, full));
      }
      check(kv.second, full);
    }
  }
};

}  // namespace

void reject_duplicate_keys(const YAML::Node& node, const std::string& what) { Walk{what}.check(node, ""); }

void check_yaml_document(const YAML::Node& node, const std::string& what, const std::string& prefix) {
  Walk{what, /*check_utf8=*/true}.check(node, prefix);
}

std::string why_not_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned c = p[i];
    std::size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the allowed range of the second byte (RFC 3629, section 4)
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) len = 3;
    else if (c == 0xED) len = 3, hi = 0x9F;  // no UTF-16 surrogates
    else if (c == 0xF0) len = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else if (c == 0xF4) len = 4, hi = 0x8F;  // nothing past U+10FFFF
    else return fmt::format("byte 0x{:02x} at offset {}", c, i);
    for (std::size_t k = 1; k < len; ++k) {
      const unsigned b = i + k < n ? p[i + k] : 0;
      if (i + k >= n || (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)))
        return fmt::format("byte 0x{:02x} at offset {} starts no valid character", c, i);
    }
    i += len;
  }
  return "";
}

std::string escape_bytes(std::string_view s) {
  std::string out;
  for (const unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) out.push_back(static_cast<char>(c));
    else out += fmt::format("\\x{:02x}", c);
  }
  return out;
}

std::string yaml_line_suffix(const YAML::Node& node) {
  const int line = node.Mark().line;
  return line >= 0 ? fmt::format(" (line {})", line + 1) : "";
}

}  // namespace keel

// Checks every keel YAML reader runs before it reads keys.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace keel {

// Throws keel::UsageError "<what>: key 'a.b' appears twice (lines 3 and 9)" when a mapping
// anywhere in `node` repeats a key. yaml-cpp keeps both entries and a lookup returns the
// first, where most YAML readers (PyYAML, for one) keep the last: the file would mean one
// thing to keel and another to whoever reads it, so it is an error rather than a choice.
void reject_duplicate_keys(const YAML::Node& node, const std::string& what);

// " (line N)" for a node read from a file; "" for one built in code (a --set override).
std::string yaml_line_suffix(const YAML::Node& node);

// The most nodes a keel YAML document may hold with its aliases expanded: a config has a few
// hundred. Aliases nested in aliases multiply (a 300-byte "billion laughs" file expands to
// 10^9 nodes, and walking it took minutes), so every walk of a document stops here.
inline constexpr std::size_t kMaxYamlNodes = 1000000;

// "" when `s` is valid UTF-8 (RFC 3629: no overlong forms, surrogates or code points past
// U+10FFFF, as JSON writers require), else where it is not: "byte 0xff at offset 4".
std::string why_not_utf8(std::string_view s);

// `s` with every byte that is not printable ASCII written as \xNN: safe in an error line.
std::string escape_bytes(std::string_view s);

// The checks every keel YAML reader runs first, in one walk bounded by kMaxYamlNodes: the
// duplicate keys of reject_duplicate_keys, more than kMaxYamlNodes nodes with aliases expanded
// ("<what>: more than 1000000 values with its aliases expanded ..."), and keys and values that
// are not UTF-8 ("<what>: key 'model.name' (line 2) is not valid UTF-8 (byte 0xff at offset 3)"),
// which would otherwise pass until the config is written into a checkpoint's JSON. `prefix`
// names where `node` sits ("model.name" for a --set value). Throws keel::UsageError.
void check_yaml_document(const YAML::Node& node, const std::string& what, const std::string& prefix = "");

}  // namespace keel

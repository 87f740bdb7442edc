// Checks every keel YAML reader runs before it reads keys.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>

namespace keel {

// Throws keel::UsageError "<what>: key 'a.b' appears twice (lines 3 and 9)" when a mapping
// anywhere in `node` repeats a key. yaml-cpp keeps both entries and a lookup returns the
// first, where most YAML readers (PyYAML, for one) keep the last: the file would mean one
// thing to keel and another to whoever reads it, so it is an error rather than a choice.
void reject_duplicate_keys(const YAML::Node& node, const std::string& what);

// " (line N)" for a node read from a file; "" for one built in code (a --set override).
std::string yaml_line_suffix(const YAML::Node& node);

}  // namespace keel

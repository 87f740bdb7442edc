// A "billion laughs" YAML document for the config-loading tests: `levels` aliases of 9 aliases
// each (9^levels values once expanded, from a few hundred bytes).
#pragma once

#include <cstddef>
#include <string>

namespace keel::test {

inline std::string alias_bomb(int levels) {
  std::string y = "a: &a [x, x, x, x, x, x, x, x, x]\n";
  const std::string names = std::string("abcdefghijklmnopqrstuvwxyz").substr(0, static_cast<std::size_t>(levels));
  for (std::size_t i = 1; i < names.size(); ++i) {
    const std::string p = "*" + names.substr(i - 1, 1);
    y += names.substr(i, 1) + ": &" + names.substr(i, 1) + " [" + p;
    for (int k = 1; k < 9; ++k) y += ", " + p;
    y += "]\n";
  }
  return y;
}

}  // namespace keel::test

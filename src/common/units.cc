#include "common/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

#include "common/error.h"

namespace keel {

std::uint64_t parse_size(std::string_view text, std::string_view what) {
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  std::uint64_t value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end == s.data()) fail("{} '{}' is not a size (examples: 8, 1K, 64M, 8G)", what, text);
  std::string_view unit(end, static_cast<size_t>(s.data() + s.size() - end));
  std::uint64_t scale = 1;
  if (!unit.empty()) {
    char u = static_cast<char>(std::toupper(static_cast<unsigned char>(unit.front())));
    switch (u) {
      case 'K': scale = 1ull << 10; break;
      case 'M': scale = 1ull << 20; break;
      case 'G': scale = 1ull << 30; break;
      case 'T': scale = 1ull << 40; break;
      case 'B': scale = 1; break;
      default: fail("{} '{}' has an unknown unit (use K, M, G or T)", what, text);
    }
    std::string_view rest = unit.substr(u == 'B' ? 1 : 1);
    if (u != 'B' && !rest.empty()) {
      if (rest == "i" || rest == "iB" || rest == "B") rest = {};
    }
    if (!rest.empty()) fail("{} '{}' has an unknown unit (use K, M, G or T)", what, text);
  }
  if (value == 0) fail("{} must be positive, got '{}'", what, text);
  if (value > UINT64_MAX / scale) fail("{} '{}' is too large", what, text);
  return value * scale;
}

std::string format_size(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  std::uint64_t v = bytes;
  while (u < 4 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    ++u;
  }
  if (v < 1024 * 1024 || u == 4) return fmt::format("{} {}", v, units[u]);
  // Not a whole multiple: show a decimal in the largest fitting unit.
  double d = static_cast<double>(bytes);
  u = 0;
  while (u < 4 && d >= 1024) {
    d /= 1024;
    ++u;
  }
  return fmt::format("{:.2f} {}", d, units[u]);
}

std::vector<std::uint64_t> geometric_sizes(std::uint64_t min, std::uint64_t max, double factor) {
  if (min == 0) fail("--min must be positive");
  if (min > max) fail("--min ({}) is larger than --max ({})", format_size(min), format_size(max));
  if (max > kMaxSweepBytes)
    fail("--max {} is too large: sizes up to {} are supported", format_size(max), format_size(kMaxSweepBytes));
  if (!std::isfinite(factor)) fail("--factor must be a finite number greater than 1, got {}", factor);
  if (!(factor > 1.0) && min != max) fail("--factor must be greater than 1, got {}", factor);
  // A factor barely above 1 would ask for millions of sizes (or none that grows in double).
  if (min != max && std::log(static_cast<double>(max) / static_cast<double>(min)) / std::log(factor) > kMaxSweepSizes)
    fail("--factor {} makes more than {:g} sizes between {} and {}: use a larger factor", factor, kMaxSweepSizes,
         format_size(min), format_size(max));
  std::vector<std::uint64_t> sizes;
  // Compared in double before converting, so no product is ever rounded into an integer
  // overflow; below max + 0.5 (exact: max <= 2^50), s rounds to at most max.
  const double limit = static_cast<double>(max) + 0.5;
  for (double s = static_cast<double>(min); s < limit; s *= factor) {
    const auto v = static_cast<std::uint64_t>(std::llround(s));
    if (sizes.empty() || v != sizes.back()) sizes.push_back(v);
    if (min == max) break;
  }
  return sizes;
}

double parse_decimal_count(std::string_view text, std::string_view what) {
  const std::string s(text);
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    throw UsageError(fmt::format("{} '{}' is not a number (examples: 1000, 300M, 500B, 14T, 2.5e12)", what, text));
  }
  const std::string unit = s.substr(used);
  double scale = 1;
  if (unit == "K" || unit == "k") scale = 1e3;
  else if (unit == "M") scale = 1e6;
  else if (unit == "B" || unit == "G") scale = 1e9;
  else if (unit == "T") scale = 1e12;
  else if (!unit.empty()) throw UsageError(fmt::format("{} '{}' has an unknown unit (K, M, B/G, T)", what, text));
  if (!(v > 0) || !std::isfinite(v * scale)) throw UsageError(fmt::format("{} must be positive (got '{}')", what, text));
  return v * scale;
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view part = text.substr(start, comma - start);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.front()))) part.remove_prefix(1);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.back()))) part.remove_suffix(1);
    if (!part.empty()) out.emplace_back(part);
    start = comma + 1;
  }
  return out;
}

std::vector<int> parse_int_list(std::string_view text, std::string_view what) {
  std::vector<int> out;
  for (const auto& part : split_list(text)) {
    int v = 0;
    auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    if (ec != std::errc() || end != part.data() + part.size() || v <= 0)
      fail("{} '{}' is not a list of positive integers (example: 2,4,8)", what, text);
    out.push_back(v);
  }
  if (out.empty()) fail("{} is empty", what);
  return out;
}

}  // namespace keel

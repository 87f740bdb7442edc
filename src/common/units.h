// Human-readable sizes: "8", "1K", "64M", "8G" (binary units, as nccl-tests takes them).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

// Parses a byte count with an optional K/M/G/T suffix (powers of 1024; a trailing "B"/"iB"
// is accepted). Throws keel::Error naming `what` on anything else, zero included.
std::uint64_t parse_size(std::string_view text, std::string_view what = "size");

// "8 B", "64 KiB", "1.5 GiB": exact binary units where possible.
std::string format_size(std::uint64_t bytes);

// The largest size a sweep may reach (1 PiB): far beyond any device's memory, and small enough
// that a size times a rank count or an element size stays exact in int64 and double.
inline constexpr std::uint64_t kMaxSweepBytes = 1ull << 50;
// The most sizes one sweep may have: each costs a full measurement per case.
inline constexpr double kMaxSweepSizes = 10000;

// Sizes from min to max (inclusive) multiplying by factor (finite, > 1): min, min*f, ... <= max.
// Throws keel::Error when max exceeds kMaxSweepBytes or the sweep would exceed kMaxSweepSizes.
std::vector<std::uint64_t> geometric_sizes(std::uint64_t min, std::uint64_t max, double factor);

// Parses a positive count in decimal units, as token budgets are written: "1000", "300M",
// "500B" (or "500G"), "14T", "2.5e12". Throws keel::UsageError naming `what` otherwise.
double parse_decimal_count(std::string_view text, std::string_view what);

// Parses a comma-separated list of positive integers ("2,4,8").
std::vector<int> parse_int_list(std::string_view text, std::string_view what);

// Splits "a,b,c" into trimmed, non-empty parts.
std::vector<std::string> split_list(std::string_view text);

}  // namespace keel

// How `keel bench mem` reports: a table per op on stdout (and the peer matrix), a versioned
// JSON document (keel.bench.mem/1, the layout of keel.bench.comm/1), CSV, and PNG plots of
// bandwidth against array size.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "bench/mem/runner.h"

namespace keel::bench {

inline constexpr const char* kMemJsonSchema = "keel.bench.mem/1";

void print_mem_header(const MemReport& report, const MemOptions& o, std::FILE* out);
// Prints rows [first_row, end) (one op) as a table; peer ops add their matrix at the largest size.
void print_mem_block(const MemReport& report, const MemOptions& o, std::size_t first_row, std::FILE* out);
// The footer; returns the number of wrong values.
std::uint64_t print_mem_summary(const MemReport& report, const MemOptions& o, std::FILE* out);

void write_mem_json(const MemReport& report, const MemOptions& o, const std::string& path);
void write_mem_csv(const MemReport& report, const std::string& path);
// Bandwidth against array size: one chart for the kernels and memcpy, one for host transfers,
// one for peer ops (mean over pairs). Returns the files written.
std::vector<std::string> write_mem_plots(const MemReport& report, const std::string& path);

}  // namespace keel::bench

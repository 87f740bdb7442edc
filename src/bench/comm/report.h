// How `keel bench comm` reports: a live table in nccl-tests' layout, a versioned JSON
// document, CSV, PNG plots of busbw against size, and the --min-busbw health gate.
#pragma once

#include <cstdio>
#include <string>

#include "bench/comm/runner.h"

namespace keel::bench {

inline constexpr const char* kCommJsonSchema = "keel.bench.comm/1";

class TablePrinter final : public RowSink {
 public:
  TablePrinter(const CommOptions& o, std::FILE* out) : o_(o), out_(out) {}
  void begin_block(const ResultRow& first) override;
  void row(const ResultRow& r) override;

 private:
  const CommOptions& o_;
  std::FILE* out_;
};

// Prints the footer (wrong values, gate). Returns the number of wrong values.
std::uint64_t print_summary(const CommReport& report, const CommOptions& o, std::FILE* out);

void write_json(const CommReport& report, const CommOptions& o, const std::string& path);
void write_csv(const CommReport& report, const std::string& path);
// One PNG per (op, dtype, redop, placement): busbw against size, one curve per rank count.
// Returns the files written.
std::vector<std::string> write_plots(const CommReport& report, const std::string& path);

// Checks, before any collective runs, that --json, --csv and --plot can be written where they
// name (an existing file is left as it is), that --plot is not a directory and that no two
// name the same file. Throws keel::Error with one line otherwise.
void check_output_paths(const CommOptions& o);

// Series that miss the gate: busbw at the largest size of each (op, dtype, redop, ranks,
// group, placement) series below `min_busbw` (0 turns the gate off). Returns one message per miss.
std::vector<std::string> busbw_gate_failures(const CommReport& report, double min_busbw);

}  // namespace keel::bench

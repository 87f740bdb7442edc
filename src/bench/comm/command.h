// `keel bench comm`: collective microbenchmarks across message sizes and GPU counts.
#pragma once

#include <CLI/CLI.hpp>

namespace keel::bench {

void add_comm_command(CLI::App& bench);

}  // namespace keel::bench

// `keel bench mem`: memory bandwidth (BabelStream kernels, copy engines, host and peer links).
#pragma once

#include <CLI/CLI.hpp>

namespace keel::bench {

void add_mem_command(CLI::App& bench);

}  // namespace keel::bench

// `keel data`: tokenize text into Megatron indexed datasets, inspect them, and walk the batches
// a data config gives (docs/data.md).
#pragma once

#include <CLI/CLI.hpp>

namespace keel::data {

void add_command(CLI::App& app);

}  // namespace keel::data

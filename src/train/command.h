// `keel train CONFIG [--set key=value ...] [--resume PATH]` (docs/train.md).
#pragma once

#include <CLI/CLI.hpp>

namespace keel::train {

void add_command(CLI::App& app);

}  // namespace keel::train

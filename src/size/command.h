// `keel size`: what a model costs and how to shape it for the hardware, before any GPU time.
#pragma once

#include <CLI/CLI.hpp>

namespace keel::size {

void add_command(CLI::App& app);

}  // namespace keel::size

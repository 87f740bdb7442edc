// `keel ckpt`: save/load demos under MPI, inspect, verify, reshard, safetensors export/import.
#pragma once

#include <CLI/CLI.hpp>

namespace keel::ckpt {

void add_command(CLI::App& app);

}  // namespace keel::ckpt

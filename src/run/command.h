// `keel run CONFIG [...]`: train through faults, unattended (run/supervisor.h,
// docs/fault_tolerance.md).
#pragma once

#include <CLI/CLI.hpp>

namespace keel::run {

void add_command(CLI::App& app);

}  // namespace keel::run

// `keel eval CHECKPOINT [--data PREFIX] [--logprobs OUT] ...`: the mean cross-entropy and
// perplexity of a checkpoint over a dataset, forward only, with keel train's backends
// (docs/eval.md).
#pragma once

#include <CLI/CLI.hpp>

namespace keel::eval {

void add_command(CLI::App& app);

}  // namespace keel::eval

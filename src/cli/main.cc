// keel: the command-line entry point. Each subcommand lives in its module and registers
// itself here; this file only dispatches and turns errors into one line and an exit code.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench/comm/command.h"
#include "bench/gemm/command.h"
#include "bench/kernels/command.h"
#include "bench/linattn/command.h"
#include "bench/mem/command.h"
#include "ckpt/command.h"
#include "common/error.h"
#include "common/mpi_session.h"
#include "common/process.h"
#include "data/command.h"
#include "eval/command.h"
#include "generate/command.h"
#include "run/command.h"
#include "size/command.h"
#include "train/command.h"

namespace {

// Optimal string alignment distance (Levenshtein with transpositions: "trian" is 1 from "train").
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// The command `word` most likely meant: the only one it begins, else the nearest within a typo or
// two; "" when none is close.
std::string closest(const std::string& word, const std::vector<std::string>& names) {
  std::string prefix_of;
  int prefixes = 0;
  for (const auto& n : names)
    if (word.size() >= 2 && n.rfind(word, 0) == 0) prefix_of = n, ++prefixes;
  if (prefixes == 1) return prefix_of;
  const std::size_t limit = word.size() <= 4 ? 1 : 2;
  std::string best;
  std::size_t best_d = limit + 1;
  for (const auto& n : names)
    if (const std::size_t d = edit_distance(word, n); d < best_d) best = n, best_d = d;
  return best;
}

// CLI11 answers a mistyped or missing command ("keel trian", "keel ckpt frobnicate", "keel")
// with "A subcommand is required", naming neither the word nor the commands. Walks the command
// words as CLI11 will and returns the line to print instead, or "" when they are fine.
std::string command_word_problem(CLI::App& app, int argc, char** argv) {
  CLI::App* cur = &app;
  std::string path = "keel";
  for (int i = 1;; ++i) {
    std::vector<std::string> names;
    for (CLI::App* sub : cur->get_subcommands([](CLI::App* a) { return !a->get_group().empty(); }))
      names.push_back(sub->get_name());
    if (names.empty()) return "";  // a command: its own arguments follow
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    if (i >= argc)
      return fmt::format("{}: missing command (one of: {}; see {} --help)", path, list, path);
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') return "";  // an option (--help, --version): CLI11's to judge
    CLI::App* next = nullptr;
    for (CLI::App* sub : cur->get_subcommands({}))
      if (sub->check_name(word)) next = sub;
    if (!next) {
      const std::string guess = closest(word, names);
      return fmt::format("unknown command '{}' for {}{} ({}'s commands: {})", word, path,
                         guess.empty() ? "" : fmt::format(": did you mean '{}'?", guess), path, list);
    }
    cur = next;
    path += " " + next->get_name();
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel: train mixture-of-experts foundation models full-stack, from cluster characterization to "
               "checkpoints"};
  app.set_version_flag("--version", std::string("keel ") + KEEL_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);

  CLI::App* bench = app.add_subcommand("bench", "Cluster characterization microbenchmarks");
  bench->require_subcommand(1);
  keel::bench::add_comm_command(*bench);
  keel::bench::add_mem_command(*bench);
  keel::bench::add_gemm_command(*bench);
  keel::bench::add_kernels_command(*bench);
  keel::bench::add_linattn_command(*bench);
  keel::size::add_command(app);
  keel::ckpt::add_command(app);
  keel::data::add_command(app);
  keel::train::add_command(app);
  keel::generate::add_command(app);
  keel::eval::add_command(app);
  keel::run::add_command(app);

  if (const std::string problem = command_word_problem(app, argc, argv); !problem.empty()) {
    // Under a launcher every rank parses the same words: let one of them speak.
    if (keel::launcher_rank() == 0) keel::report_error(problem);
    return keel::kExitError;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Under a launcher every rank parses the same flags: let one of them speak.
    if (keel::launcher_rank() > 0) return e.get_exit_code() == 0 ? 0 : keel::kExitError;
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    // one line, as every other error (CLI11's own adds a second)
    keel::report_error(fmt::format("{} (see --help)", e.what()));
    return keel::kExitError;
  } catch (const keel::UsageError& e) {
    if (keel::launcher_rank() == 0) keel::report_error(e.what());
    keel::finish_mpi_after_error(/*all_ranks_failed=*/true);
    return keel::kExitError;
  } catch (const std::exception& e) {
    // A failure of this rank alone (a library call, a file): say so, then stop the job.
    keel::report_error(e.what());
    keel::finish_mpi_after_error(/*all_ranks_failed=*/false);
    return keel::kExitError;
  }
  return keel::exit_code();
}

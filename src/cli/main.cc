// keel: the command-line entry point. Each subcommand lives in its module and registers
// itself here; this file only dispatches and turns errors into one line and an exit code.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>

#include "bench/comm/command.h"
#include "bench/gemm/command.h"
#include "bench/mem/command.h"
#include "ckpt/command.h"
#include "common/error.h"
#include "common/mpi_session.h"
#include "common/process.h"
#include "data/command.h"
#include "generate/command.h"
#include "size/command.h"
#include "train/command.h"

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
  keel::size::add_command(app);
  keel::ckpt::add_command(app);
  keel::data::add_command(app);
  keel::train::add_command(app);
  keel::generate::add_command(app);

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

#include "bench/comm/command.h"

#include <cstdio>
#include <memory>
#include <string>

#include "bench/comm/report.h"
#include "bench/comm/runner.h"
#include "common/error.h"
#include "device/cuda_devices.h"
#include "common/mpi_session.h"
#include "common/process.h"
#include "common/units.h"
#include "common/watchdog.h"

namespace keel::bench {
namespace {

struct RawFlags {
  std::string backend = "auto", op = "all_reduce", dtype = "fp32", redop = "sum", placement = "both";
  std::string min = "8", max = "64M", ranks;
  double factor = 2;
  bool all_groups = false, no_check = false, quiet = false;
  int root = 0, warmup = 5, iters = 20, graph = 0, hang_rank = -1, corrupt_rank = -1, error_rank = -1;
  std::string hang_at = "case";
  double timeout = kDefaultTimeoutSeconds, min_busbw = 0;
  std::uint64_t seed = 1;
  std::string json, csv, plot;
};

CommOptions to_options(const RawFlags& f) {
  try {
    CommOptions o;
    o.backend = f.backend;
    if (o.backend != "auto" && o.backend != "nccl" && o.backend != "mpi")
      fail("unknown --backend '{}' (choose auto, nccl or mpi)", f.backend);
    o.ops = parse_collectives(f.op);
    o.dtypes.clear();
    for (const auto& t : split_list(f.dtype)) o.dtypes.push_back(parse_dtype(t));
    if (o.dtypes.empty()) fail("--dtype is empty");
    o.redops.clear();
    for (const auto& r : split_list(f.redop)) o.redops.push_back(parse_redop(r));
    if (o.redops.empty()) fail("--redop is empty");
    if (f.placement == "both") o.placement = Placement::kBoth;
    else if (f.placement == "out" || f.placement == "out-of-place") o.placement = Placement::kOutOfPlace;
    else if (f.placement == "in" || f.placement == "in-place") o.placement = Placement::kInPlace;
    else fail("unknown --placement '{}' (choose both, out or in)", f.placement);
    o.min_bytes = parse_size(f.min, "--min");
    o.max_bytes = parse_size(f.max, "--max");
    o.factor = f.factor;
    if (!f.ranks.empty()) o.ranks = parse_int_list(f.ranks, "--ranks");
    o.all_groups = f.all_groups;
    o.root = f.root;
    if (o.root < 0) fail("--root must not be negative");
    o.plan.warmup = f.warmup;
    o.plan.iters = f.iters;
    o.plan.graph_replays = f.graph;
    o.plan.timeout_s = f.timeout;
    o.check = !f.no_check;
    o.seed = f.seed;
    o.json_path = f.json;
    o.csv_path = f.csv;
    o.plot_path = f.plot;
    o.min_busbw = f.min_busbw;
    o.hang_rank = f.hang_rank;
    if (f.hang_at != "case" && f.hang_at != "start") fail("unknown --inject-hang-at '{}' (case or start)", f.hang_at);
    o.hang_at_start = f.hang_at == "start";
    o.corrupt_rank = f.corrupt_rank;
    o.error_rank = f.error_rank;
    o.quiet = f.quiet;
    (void)geometric_sizes(o.min_bytes, o.max_bytes, o.factor);
    return o;
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

// Runs the sweep, prints and writes the report on rank 0 and returns the exit code every
// rank leaves with (rank 0's verdict).
int report_and_judge(Backend& backend, const CommOptions& o, const MpiSession& mpi) {
  const bool root = mpi.rank() == 0;
  std::FILE* out = stdout;
  if (root && !o.quiet) {
    std::fprintf(out, "# keel bench comm  |  backend %s  |  world %d ranks  |  %s\n", o.backend.c_str(),
                 backend.world_size(), mpi.version().c_str());
    for (const auto& [k, v] : backend.library_versions())
      if (k != "mpi") std::fprintf(out, "#   %s %s\n", k.c_str(), v.c_str());
  }
  TablePrinter printer(o, out);
  CommReport report = run_comm_bench(backend, o, root && !o.quiet ? &printer : nullptr);
  if (root && !o.quiet) {
    std::fprintf(out, "#\n# Devices:\n");
    for (const auto& d : report.devices)
      std::fprintf(out, "#   rank %3d  %s  %s %s\n", d.rank, d.host.c_str(), d.name.c_str(), d.bus_id.c_str());
  }

  int code = kExitOk;
  if (root) {
    if (!o.quiet) print_summary(report, o, out);
    std::uint64_t total_wrong = 0;
    for (const auto& r : report.rows) total_wrong += r.out_of_place.wrong + r.in_place.wrong;
    if (!o.json_path.empty()) write_json(report, o, o.json_path);
    if (!o.csv_path.empty()) write_csv(report, o.csv_path);
    if (!o.plot_path.empty())
      for (const auto& f : write_plots(report, o.plot_path))
        if (!o.quiet) std::fprintf(out, "# plot: %s\n", f.c_str());
    if (total_wrong > 0) {
      report_error(fmt::format("{} wrong values: the collectives did not produce their expected results", total_wrong));
      code = kExitCheckFailed;
    }
    const auto misses = busbw_gate_failures(report, o.min_busbw);
    for (const auto& m : misses) report_error(m);
    if (code == kExitOk && !misses.empty()) code = kExitBelowGate;
  }
  std::fflush(stdout);
  // Every rank leaves with rank 0's verdict.
  mpi_check(MPI_Bcast(&code, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
  return code;
}

// Rank 0 writes the results: it checks the output paths before the sweep, so a bad path costs
// seconds, not the hours of a sweep whose results then cannot be written. Every rank gets the
// verdict, so all of them stop together instead of waiting in the first collective.
void check_outputs_before_sweep(const CommOptions& o, const MpiSession& mpi) {
  std::string problem;
  if (mpi.rank() == 0) {
    try {
      check_output_paths(o);
    } catch (const Error& e) {
      problem = e.what();
    }
  }
  broadcast_string(problem, 0, MPI_COMM_WORLD);
  if (!problem.empty()) throw UsageError(problem);  // printed once, by rank 0
}

// Every buffer of the sweep must fit before the first is allocated: an 8 GiB sweep on CPU ranks
// (`--backend mpi -b 8G -e 8G`) filled its buffers until the kernel's OOM killer ended it after
// 44 s, exit 137 and no keel line. Each process checks its own memory (host memory shared with
// the world's other ranks on its host; or its GPUs' free memory); the lowest rank that finds a
// problem speaks for all, so every rank stops with the same line.
void check_memory_before_sweep(const Backend& backend, const CommOptions& o, const MpiSession& mpi) {
  const SweepBuffers need = largest_buffers(o, backend.world_size());
  PeerWait wait("the memory check before the sweep (MPI_Comm_split_type, MPI_Allreduce)");
  MPI_Comm host = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, mpi.rank(), MPI_INFO_NULL, &host),
            "MPI_Comm_split_type");
  int ranks_on_host = 1;
  MPI_Comm_size(host, &ranks_on_host);
  MPI_Comm_free(&host);
  std::string problem = backend.memory_problem(need, ranks_on_host);
  const int mine = problem.empty() ? mpi.size() : mpi.rank();
  int first = mine;
  mpi_check(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  if (first == mpi.size()) return;
  broadcast_string(problem, first, MPI_COMM_WORLD);
  throw UsageError(problem);  // printed once, by rank 0
}

int run(const RawFlags& flags) {
  CommOptions o = to_options(flags);  // before MPI: a bad flag needs no ranks
  MpiSession mpi;
  // Start-up waits on every rank too (the output check's broadcast, NCCL's bootstrap), so a rank
  // that never gets there is a timeout naming it, as in the sweep (runner.cc), not a hang.
  Watchdog startup;
  if (mpi.size() > 1) startup.track_peer_waits();
  startup.arm("starting up (output check, communicators)", o.plan.timeout_s);
  if (o.hang_at_start && mpi.rank() == o.hang_rank) hang_forever();
  check_outputs_before_sweep(o, mpi);
  int max_ranks = 0;
  for (int n : o.ranks) max_ranks = std::max(max_ranks, n);

  std::unique_ptr<Backend> backend;
  std::string chosen = o.backend;
#if defined(KEEL_HAVE_CUDA)
  if (chosen == "auto") chosen = visible_cuda_devices() > 0 ? "nccl" : "mpi";
  if (chosen == "nccl") backend = make_nccl_backend(max_ranks);
#else
  if (chosen == "auto") chosen = "mpi";
  if (chosen == "nccl") throw UsageError("this keel was built without CUDA: --backend nccl is unavailable");
#endif
  if (chosen == "mpi") backend = make_mpi_backend();
  o.backend = chosen;
  validate_options(o, backend->world_size());
  check_memory_before_sweep(*backend, o, mpi);
  startup.disarm();

  // Releasing communicators can itself hang after a failure (a kernel still waiting for a
  // dead peer): the watchdog covers the teardown too.
  Watchdog teardown;
  int code = kExitOk;
  try {
    code = report_and_judge(*backend, o, mpi);
  } catch (...) {
    backend->set_failed();
    teardown.arm("releasing communicators after an error", 30);
    backend.reset();
    throw;
  }
  teardown.arm("releasing communicators", o.plan.timeout_s);
  backend.reset();
  return code;
}

}  // namespace

void add_comm_command(CLI::App& bench) {
  auto flags = std::make_shared<RawFlags>();
  CLI::App* cmd = bench.add_subcommand(
      "comm",
      "Collective microbenchmarks (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send_recv) across "
      "message sizes and rank counts, with nccl-tests' algbw/busbw conventions and every result checked.\n"
      "GPUs: one process per GPU under mpirun/srun, or run without a launcher to drive all local GPUs.\n"
      "CPUs: --backend mpi under mpirun.");
  cmd->add_option("--backend", flags->backend, "auto (nccl if a GPU is visible, else mpi), nccl or mpi")
      ->capture_default_str();
  cmd->add_option("--op", flags->op, "Comma list of collectives, or 'all'")->capture_default_str();
  cmd->add_option("--dtype", flags->dtype, "Comma list of bf16, fp16, fp32")->capture_default_str();
  cmd->add_option("--redop", flags->redop, "Comma list of sum, avg (reducing collectives)")->capture_default_str();
  cmd->add_option("--placement", flags->placement, "both, out (out-of-place) or in (in-place)")->capture_default_str();
  cmd->add_option("-b,--min", flags->min, "Smallest message (bytes; K/M/G/T suffixes)")->capture_default_str();
  cmd->add_option("-e,--max", flags->max, "Largest message")->capture_default_str();
  cmd->add_option("-f,--factor", flags->factor, "Size multiplier between steps")->capture_default_str();
  cmd->add_option("--ranks", flags->ranks, "Comma list of rank (GPU) counts to sweep, e.g. 2,4,8 (default: all)");
  cmd->add_flag("--all-groups", flags->all_groups,
                "Run every group of each size at once (world split into consecutive groups) to see contention");
  cmd->add_option("--root", flags->root, "Broadcast root (group rank)")->capture_default_str();
  cmd->add_option("-w,--warmup", flags->warmup, "Untimed operations before timing")->capture_default_str();
  cmd->add_option("-n,--iters", flags->iters, "Timed operations per size")->capture_default_str();
  cmd->add_option("-G,--graph", flags->graph,
                  "Capture the timed operations in a CUDA graph and replay it N times (small-message latency without "
                  "launch overhead); 0 = host-timed loop")
      ->capture_default_str();
  cmd->add_option("--timeout", flags->timeout,
                  "Seconds before a hung collective is an error (exit 124); 0 or inf: no deadline")
      ->capture_default_str();
  cmd->add_flag("--no-check", flags->no_check, "Skip checking results (they are checked by default)");
  cmd->add_option("--seed", flags->seed, "Seed of the checked input data")->capture_default_str();
  cmd->add_option("--json", flags->json, "Write results as JSON (schema keel.bench.comm/1)");
  cmd->add_option("--csv", flags->csv, "Write results as CSV");
  cmd->add_option("--plot", flags->plot, "Write PNG plots of busbw against size (one file per op/dtype)");
  cmd->add_option("--min-busbw", flags->min_busbw,
                  "Health gate: exit 3 when the busbw at the largest size of any series is below this (GB/s)");
  cmd->add_flag("-q,--quiet", flags->quiet, "No table on stdout");
  cmd->add_option("--inject-hang", flags->hang_rank, "Testing: this rank stops taking part (exercises --timeout)")
      ->group("");
  cmd->add_option("--inject-hang-at", flags->hang_at, "Testing: where --inject-hang stops: case (default) or start")
      ->group("");
  cmd->add_option("--inject-corrupt", flags->corrupt_rank,
                  "Testing: overwrite one checked output element on this rank (exercises the checker)")
      ->group("");
  cmd->add_option("--inject-error", flags->error_rank, "Testing: this rank fails with an error (the job must stop)")
      ->group("");
  cmd->callback([flags] { set_exit_code(run(*flags)); });
}

}  // namespace keel::bench

#include "bench/mem/command.h"

#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "bench/mem/report.h"
#include "bench/mem/runner.h"
#include "common/error.h"
#include "device/cuda_devices.h"
#include "common/process.h"
#include "common/units.h"

namespace keel::bench {
namespace {

struct RawFlags {
  std::string backend = "auto", op, dtype = "fp32", min, max;
  double factor = 2, peak_gbps = 0, min_sample_us = 20;
  int warmup = 5, iters = 50, device = 0, threads = 0;
  bool no_check = false, quiet = false, corrupt = false;
  std::uint64_t seed = 1;
  std::string json, csv, plot;
};

MemOptions to_options(const RawFlags& f) {
  try {
    MemOptions o;
    o.backend = f.backend;
    if (o.backend != "auto" && o.backend != "cuda" && o.backend != "cpu")
      fail("unknown --backend '{}' (choose auto, cuda or cpu)", f.backend);
    if (!f.op.empty()) {
      o.ops = parse_mem_ops(f.op);
      for (const auto& name : split_list(f.op))
        if (name != "all" && name != "stream" && name != "transfers" && name != "peer")
          o.named_ops.push_back(parse_mem_ops(name).front());
    }
    o.type = parse_mem_type(f.dtype);
    if (!f.min.empty()) o.min_bytes = parse_size(f.min, "--min");
    if (!f.max.empty()) o.max_bytes = parse_size(f.max, "--max");
    if (o.min_bytes && o.max_bytes && o.min_bytes > o.max_bytes)
      fail("--min ({}) is larger than --max ({})", format_size(o.min_bytes), format_size(o.max_bytes));
    if (f.factor <= 1) fail("--factor must be larger than 1, got {}", f.factor);
    o.factor = f.factor;
    if (f.iters < 1) fail("--iters must be at least 1, got {}", f.iters);
    if (f.warmup < 0) fail("--warmup must not be negative, got {}", f.warmup);
    if (f.device < 0) fail("--device must not be negative, got {}", f.device);
    if (f.threads < 0) fail("--threads must not be negative, got {}", f.threads);
    if (f.threads > max_cpu_threads())
      fail("--threads {} is more than {} (the larger of 64 and 4 x the {} hardware threads; more only measures the "
           "scheduler)",
           f.threads, max_cpu_threads(), std::thread::hardware_concurrency());
    if (f.peak_gbps < 0) fail("--peak-gbps must not be negative");
    o.plan.warmup = f.warmup;
    o.plan.iters = f.iters;
    o.plan.min_sample_us = f.min_sample_us;
    o.plan.check = !f.no_check;
    o.plan.seed = f.seed;
    o.plan.corrupt = f.corrupt;
    o.device = f.device;
    o.threads = f.threads;
    o.peak_gbps = f.peak_gbps;
    o.json_path = f.json;
    o.csv_path = f.csv;
    o.plot_path = f.plot;
    o.quiet = f.quiet;
    return o;
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

int run(const RawFlags& flags) {
  MemOptions o = to_options(flags);
  std::unique_ptr<MemBackend> backend;
  std::string chosen = o.backend;
#if defined(KEEL_HAVE_CUDA)
  if (chosen == "auto") chosen = visible_cuda_devices() > 0 ? "cuda" : "cpu";
  if (chosen == "cuda") backend = make_cuda_mem_backend(o.device);
#else
  if (chosen == "auto") chosen = "cpu";
  if (chosen == "cuda") throw UsageError("this keel was built without CUDA: --backend cuda is unavailable");
#endif
  if (chosen == "cpu") {
    if (o.device != 0) throw UsageError("--device needs --backend cuda");
    backend = make_cpu_mem_backend(o.threads);
  }
  o.backend = chosen;

  std::FILE* out = stdout;
  bool header = false;
  MemReport report = run_mem_bench(*backend, o, [&](const MemReport& r, std::size_t first_row) {
    if (o.quiet) return;
    if (!header) print_mem_header(r, o, out);
    header = true;
    print_mem_block(r, o, first_row, out);
  });
  const std::uint64_t wrong = o.quiet ? 0 : print_mem_summary(report, o, out);
  (void)wrong;
  std::uint64_t total_wrong = 0;
  for (const auto& r : report.rows) total_wrong += r.wrong;
  if (!o.json_path.empty()) write_mem_json(report, o, o.json_path);
  if (!o.csv_path.empty()) write_mem_csv(report, o.csv_path);
  if (!o.plot_path.empty())
    for (const auto& f : write_mem_plots(report, o.plot_path))
      if (!o.quiet) std::fprintf(out, "# plot: %s\n", f.c_str());
  std::fflush(out);
  if (total_wrong > 0) {
    report_error(fmt::format("{} wrong values: the kernels did not produce their expected results", total_wrong));
    return kExitCheckFailed;
  }
  return kExitOk;
}

}  // namespace

void add_mem_command(CLI::App& bench) {
  auto flags = std::make_shared<RawFlags>();
  CLI::App* cmd = bench.add_subcommand(
      "mem",
      "Memory bandwidth: the BabelStream kernels (copy, mul, add, triad, dot, nstream) from cache-resident to many "
      "times L2, the copy engine within a device, host<->device (pinned and pageable) and GPU<->GPU (read/write, "
      "one way and both) transfers. Bandwidth counts bytes read + bytes written over the best time (BabelStream); "
      "every figure also as % of the spec peak and of the best measured; every output checked.\n"
      "GPUs: --backend cuda; CPUs: --backend cpu (threads over host memory).");
  cmd->add_option("--backend", flags->backend, "auto (cuda if a GPU is visible, else cpu), cuda or cpu")
      ->capture_default_str();
  cmd->add_option("--op", flags->op,
                  "Comma list of copy, mul, add, triad, dot, nstream, memcpy, h2d_pinned, h2d_pageable, d2h_pinned, "
                  "d2h_pageable, peer_write, peer_read, peer_bidir_write, peer_bidir_read, or the groups stream, "
                  "transfers, peer, all (default: all the backend can run)");
  cmd->add_option("--dtype", flags->dtype, "fp32 or fp64")->capture_default_str();
  cmd->add_option("-b,--min", flags->min, "Smallest array (bytes; K/M/G suffixes; default 256K on GPUs, 64K on CPUs)");
  cmd->add_option("-e,--max", flags->max, "Largest array (default 2G on GPUs, 256M on CPUs)");
  cmd->add_option("-f,--factor", flags->factor, "Size multiplier between steps")->capture_default_str();
  cmd->add_option("-w,--warmup", flags->warmup, "Untimed runs before timing")->capture_default_str();
  cmd->add_option("-n,--iters", flags->iters, "Timed samples per size")->capture_default_str();
  cmd->add_option("--min-sample-us", flags->min_sample_us,
                  "Small arrays: repeat the op inside one sample until it lasts this long (a CUDA graph on GPUs)")
      ->capture_default_str();
  cmd->add_option("--device", flags->device, "GPU for single-device ops")->capture_default_str();
  cmd->add_option("--threads", flags->threads,
                  "CPU backend: threads (default: every hardware thread; at most the larger of 64 and 4 x those)");
  cmd->add_option("--peak-gbps", flags->peak_gbps,
                  "Memory spec peak for %peak (GB/s); GPUs default to their built-in profile, CPUs have none");
  cmd->add_flag("--no-check", flags->no_check, "Skip checking results (they are checked by default)");
  cmd->add_option("--seed", flags->seed, "Seed of the random inputs")->capture_default_str();
  cmd->add_option("--json", flags->json, "Write results as JSON (schema keel.bench.mem/1)");
  cmd->add_option("--csv", flags->csv, "Write results as CSV");
  cmd->add_option("--plot", flags->plot, "Write PNG plots of bandwidth against array size");
  cmd->add_flag("-q,--quiet", flags->quiet, "No table on stdout");
  cmd->add_flag("--inject-corrupt", flags->corrupt, "Testing: damage one output element (exercises the checker)")
      ->group("");
  cmd->callback([flags] { set_exit_code(run(*flags)); });
}

}  // namespace keel::bench

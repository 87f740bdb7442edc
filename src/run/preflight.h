// keel run's pre-flight health gate (docs/fault_tolerance.md, "Pre-flight"): before an attempt,
// keel's own microbenchmarks, briefly, on every rank the job is about to use, under the job's
// launcher and rank count:
//   gemm  keel bench gemm, one shape (bf16 8192^3 on GPUs, fp32 1024^3 on CPU ranks): TFLOP/s
//   mem   keel bench mem, triad on one array (1 GiB on GPUs, 64 MiB on CPU ranks): GB/s
//   comm  with several ranks, keel bench comm: all-reduce bus bandwidth of the world (one size)
// Each rank writes its figures (and its host) under the attempt's pre-flight directory. A rank
// whose GEMM or memory figure is below `fraction` x the other ranks' median, or any figure below its
// floor, fails the gate and is named with its host and device; keel run then takes its device out
// of the job (run/supervisor.h: the next attempt runs on the others, the global batch kept) or,
// with --no-exclude, stops before the attempt, nothing of the job lost.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace keel::run {

struct PreflightOptions {
  bool enabled = false;
  double fraction = 0.7;  // of the other ranks' median (gemm, mem)
  double gemm_floor = 0, mem_floor = 0, comm_floor = 0;  // TFLOP/s, GB/s, GB/s (0: none)
};

// Parses --preflight-floor "gemm=TFLOPS,mem=GBPS,comm=GBPS" (any subset) into o; keel::UsageError
// naming the word otherwise.
void parse_preflight_floors(const std::string& text, PreflightOptions& o);

struct RankHealth {
  int rank = 0;
  std::string host, device;
  double gemm_tflops = 0, mem_gbps = 0;
  bool injected = false;  // a failing check injected (health@A:rR): its figures cut to a hundredth
};

struct Preflight {
  std::vector<RankHealth> ranks;
  double comm_busbw = 0;  // GB/s, 0 with one rank
  double gemm_median = 0, mem_median = 0;
  std::vector<std::string> failures;  // one line each ("rank 1 (host h, device d): gemm ...")
  std::vector<int> failed_ranks;      // the ranks of those lines (once each)
  bool comm_failed = false;           // the all-reduce below its floor (no one rank to blame)
  double seconds = 0;
};

// The verdict on the figures: fills the medians and failures (pure; no process runs).
void judge(Preflight& p, const PreflightOptions& o);

// Runs the benchmarks: `exe` is keel itself, `launch` the argv that starts `ranks` processes
// before a command (empty for one), `dir` the directory for their output, `cuda` whether the job
// trains on GPUs; `injected` the ranks whose checks fail by injection. Throws keel::Error when a
// benchmark does not run (its last output lines in the message).
Preflight run_preflight(const std::string& exe, const std::vector<std::string>& launch, int ranks,
                        const std::string& dir, bool cuda, const std::vector<int>& injected,
                        const PreflightOptions& o);

// The event logged for it.
nlohmann::json preflight_event(const Preflight& p, int attempt);

// A device taken out of the job, kept across keel run invocations in the bad list
// (<output_dir>/run_excluded.json): its host, its id among the host's GPUs as keel run saw them
// (CUDA_VISIBLE_DEVICES's, else the index; empty for a CPU rank: one rank fewer on the host),
// what it was, why, and when.
struct Excluded {
  std::string host, gpu, device, reason;
  int attempt = 0;
  int ranks = 0;  // a job on several nodes takes the whole node out (gpu empty): the ranks it ran
};
// The list (empty when the file does not exist); keel::Error naming the file when it is not one.
std::vector<Excluded> load_excluded(const std::string& path);
void save_excluded(const std::string& path, const std::vector<Excluded>& list);

}  // namespace keel::run

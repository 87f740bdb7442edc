#include "train/command.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/faults.h"
#include "common/fileio.h"
#include "common/hash.h"
#include "common/mpi_session.h"
#include "common/process.h"
#include "common/stack_dump.h"
#include "common/stop_signal.h"
#include "common/udp.h"
#include "common/watchdog.h"
#include "device/cuda_devices.h"
#include "device/rank_gpu.h"
#include "parallel/plan.h"
#include "train/backend.h"
#include "train/step_profile.h"
#include "train/trainer.h"

namespace keel::train {
namespace {

// The run's mesh: world = parallel.data x parallel.context x parallel.tsp x parallel.tensor
// (parallel.data 0: the world over the others), tensor groups of consecutive ranks, then tsp
// groups, then context groups;
// expert parallelism is folded into the data x context ranks (parallel.expert consecutive ones
// hold all experts). Resolves `device: auto` to cuda or cpu alike on every rank. With several ranks on
// GPUs, each rank takes its node-local rank's GPU or the one its launcher bound it to
// (device/rank_gpu.h). Checked before any GPU work, alike on every rank.
parallel::Mesh make_mesh(TrainConfig& cfg, const MpiSession& mpi) {
  const int tensor = cfg.parallel_tensor * cfg.parallel_tsp, context = cfg.parallel_context;
  const std::string model_axes = cfg.parallel_tsp > 1 ? fmt::format("parallel.tsp ({})", cfg.parallel_tsp)
                                                      : fmt::format("parallel.tensor ({})", cfg.parallel_tensor);
  if (cfg.parallel_data == 0 && mpi.size() % (tensor * context) != 0)
    throw UsageError(fmt::format("{}: parallel.context ({}) x {} must divide the number of ranks ({})", cfg.path, context,
                                 model_axes, mpi.size()));
  const int data = cfg.parallel_data == 0 ? mpi.size() / (tensor * context) : cfg.parallel_data;
  if (static_cast<long>(data) * context * tensor != mpi.size())
    throw UsageError(fmt::format("{}: parallel.data ({}) x parallel.context ({}) x {} must equal the number of ranks "
                                 "({}); set parallel.data: 0 to use every rank",
                                 cfg.path, data, context, model_axes, mpi.size()));
  if ((data * context) % cfg.parallel_expert != 0 || cfg.model.experts % cfg.parallel_expert != 0)
    throw UsageError(fmt::format("{}: parallel.expert ({}) must divide the data x context ranks ({}) and the experts ({})",
                                 cfg.path, cfg.parallel_expert, data * context, cfg.model.experts));
  // Every rank decides alike whether it trains on a GPU: an error on some ranks only would leave
  // the rest waiting in the next collective, and `auto` would pick CPU on some, CUDA on others.
  int sees = visible_cuda_devices() > 0 ? 1 : 0, fewest = sees, most = sees;
  if (mpi.size() > 1 && cfg.device != "cpu") {
    PeerWait wait("MPI_Allreduce (which ranks see a GPU)");
    mpi_check(MPI_Allreduce(&sees, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
    mpi_check(MPI_Allreduce(&sees, &most, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
  }
  const bool cuda = cfg.device == "cuda" || (cfg.device == "auto" && most > 0);
  cfg.device = cuda ? "cuda" : "cpu";  // the Trainer follows this choice, made alike on every rank
  if (mpi.size() > 1 && cfg.device != "cpu") {
    if (fewest != most)
      throw UsageError(fmt::format("device: {}: some ranks see a CUDA device and some do not (check "
                                   "CUDA_VISIBLE_DEVICES and the launcher's GPU binding, or set device: cpu)",
                                   cfg.device));
    if (cuda && most == 0) throw UsageError("device: cuda: no CUDA device is visible");
    if (cuda) bind_rank_gpu();  // the node-local rank's GPU, or the one a launcher bound it to
  }
  parallel::check_context_split(static_cast<std::int64_t>(cfg.data.seq_length), context * cfg.parallel_tsp,
                                parallel::context_halo(cfg.model), cfg.path);
  mesh::Shape shape;
  shape.dp = data;
  shape.cp = context;
  shape.tp = cfg.parallel_tensor;
  shape.tsp = cfg.parallel_tsp;
  shape.ep = cfg.parallel_expert;
  shape.zero = data * context > 1 ? 1 : 0;
  return parallel::Mesh(shape, mpi.size() > 1 ? MPI_COMM_WORLD : MPI_COMM_NULL, cfg.path + ": parallel");
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::size_t b = 0;
  while (b <= text.size()) {
    const std::size_t e = std::min(text.find('\n', b), text.size());
    out.push_back(text.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

// Line i of an emitted YAML mapping with its parents' keys: "optimizer.lr: 0.3".
std::string dotted_line(const std::vector<std::string>& lines, std::size_t i) {
  if (i >= lines.size()) return "(nothing)";
  auto indent = [](const std::string& l) { return l.find_first_not_of(' '); };
  std::string path = lines[i].substr(std::min(indent(lines[i]), lines[i].size()));
  std::size_t level = indent(lines[i]);
  for (std::size_t j = i; j-- > 0 && level > 0 && level != std::string::npos;) {
    const std::size_t d = indent(lines[j]);
    if (d == std::string::npos || d >= level) continue;
    const std::string key = lines[j].substr(d, lines[j].find(':', d) - d);
    path = key + "." + path;
    level = d;
  }
  return path;
}

// Every rank must train the same thing: a rank launched with another config or --set (an MPMD
// launch, a stale file on one node) would otherwise hang, crash in a collective of the wrong
// length, or train silently on mixed settings and commit a checkpoint nothing can load. The
// hashes go round first; the first differing rank then says what differs, and every rank
// stops with that one line.
void require_same_config_on_every_rank(const std::string& text, const MpiSession& mpi) {
  if (mpi.size() < 2) return;
  const std::uint64_t mine = fnv1a(text);  // common/hash.h: the same in every binary of an MPMD launch
  std::vector<std::uint64_t> all(static_cast<std::size_t>(mpi.size()));
  {
    PeerWait wait("MPI_Allgather (the config's hash)");
    mpi_check(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD), "MPI_Allgather");
  }
  int first = -1, differing = 0;
  for (int r = 1; r < mpi.size(); ++r)
    if (all[static_cast<std::size_t>(r)] != all[0]) differing += 1, first = first < 0 ? r : first;
  if (differing == 0) return;
  std::string zero = text;
  broadcast_string(zero, 0, MPI_COMM_WORLD);
  std::string what;
  if (mpi.rank() == first) {
    const auto a = lines_of(text), b = lines_of(zero);
    std::size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
    what = fmt::format("'{}' where rank 0 has '{}'", dotted_line(a, i), dotted_line(b, i));
  }
  broadcast_string(what, first, MPI_COMM_WORLD);
  throw UsageError(fmt::format("ranks disagree on the config: rank {} has {} ({} of {} ranks differ from rank 0): "
                               "launch every rank with the same config and flags",
                               first, what, differing, mpi.size()));
}

}  // namespace

void add_command(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> sets;
    std::string resume;
    std::int64_t until = -1;
    double timeout = kDefaultTimeoutSeconds;  // keel's --timeout (common/watchdog.h)
    int hang_rank = -1;
    std::int64_t hang_step = -1;  // 0: at start-up, before the ranks compare their configs
    std::vector<std::string> inject;        // fault specs (common/faults.h)
    std::string heartbeat;                  // directory of the ranks' heartbeat files
    std::string heartbeat_udp;              // HOST:PORT[/TAG]: the heartbeats also as datagrams
    std::vector<std::int64_t> skip_steps;   // steps whose data is skipped
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train a decoder-only MoE transformer from a YAML training config: one GPU or the CPU, or data-parallel "
      "(ZeRO-1) over the ranks of `mpirun -np N` / `srun` (one rank per GPU)");
  cmd->add_option("config", args->config, "Training config (YAML)")->required();
  cmd->add_option("--set", args->sets, "Override a config key: --set optimizer.lr=1e-3 (repeatable)");
  cmd->add_option("--resume", args->resume, "Continue from a checkpoint: a checkpoint.dir root (its latest) or one step directory");
  CLI::Option* stop_after = cmd->add_option("--stop-after", args->until,
                  "Stop after this many optimizer steps in total (the schedule still spans `steps`); saves a checkpoint");
  cmd->add_option("--timeout", args->timeout,
                  "Seconds a rank may go without progress (start-up, resume, each step, eval, checkpoint phase) before "
                  "it exits with an error (124), as when a rank hangs or dies; 0 or inf: no deadline")
      ->capture_default_str();
  cmd->add_option("--inject-hang-rank", args->hang_rank, "Fault injection (tests): this rank hangs at --inject-hang-step");
  cmd->add_option("--inject-hang-step", args->hang_step,
                  "Fault injection (tests): the step at which it hangs (0: at start-up, before the config check)");
  cmd->add_option("--inject", args->inject,
                  "Fault injection (tests, supervisor drills; repeatable): a comma list of KIND@STEP[:rRANK][:ARG]: "
                  "kill@S (SIGKILL), exit@S[:CODE] (_exit, default 3), hang@S, slow@S[-E][:MS] (sleep MS ms, default "
                  "500, at each step S..E), nan@S (the step's loss is NaN), spike@S[:FACTOR] (the step's loss times "
                  "FACTOR, default 100), diskfull@S (the write of step S's checkpoint fails with ENOSPC), slowsave@S[:MS] "
                  "(the writes of step S's checkpoint take at least MS ms, default 5000); at the start "
                  "of step S on world rank RANK (default 0)");
  CLI::Option* heartbeat = cmd->add_option("--heartbeat", args->heartbeat,
                  "Every rank writes DIR/rank-<rank>.json after start-up, after every step and at the end: "
                  "{rank, step, time, step_seconds, phase (start|step|save|done), host, pid, world}");
  cmd->add_option("--heartbeat-udp", args->heartbeat_udp,
                  "HOST:PORT[/TAG]: every heartbeat also goes as one UDP datagram there (the same JSON, with \"tag\": "
                  "TAG), never blocking the step loop; with or without --heartbeat (keel run listens on several nodes)");
  cmd->add_option("--skip-step", args->skip_steps,
                  "Skip the data of step S (repeatable): before step S the loader drops that step's micro-batches and "
                  "step S trains on the following ones; nothing for a step at or before the one resumed from");
  cmd->callback([args, stop_after, heartbeat] {
    check_timeout_flag(args->timeout);  // >= 0; 0 or inf: no deadline
    if (stop_after->count() > 0 && args->until < 1)
      throw UsageError(fmt::format("--stop-after {}: must be a step count >= 1", args->until));
    if (args->hang_step < -1) throw UsageError("--inject-hang-step must be >= 0 (0: at start-up)");
    FaultPlan faults;
    for (const std::string& spec : args->inject) faults.add(parse_faults(spec, "--inject"));
    for (const std::int64_t s : args->skip_steps)
      if (s < 1) throw UsageError(fmt::format("--skip-step {}: must be a step >= 1 (steps count from 1)", s));
    if (heartbeat->count() > 0 && args->heartbeat.empty())
      throw UsageError("--heartbeat: needs a directory (it is created when missing)");
    std::unique_ptr<UdpSender> udp;
    std::string udp_tag;
    if (!args->heartbeat_udp.empty()) {
      const std::string& u = args->heartbeat_udp;
      const auto slash = u.find('/');
      udp_tag = slash == std::string::npos ? "" : u.substr(slash + 1);
      std::string host, why;
      int port = 0;
      if (!parse_host_port(u.substr(0, slash), &host, &port, &why))
        throw UsageError(fmt::format("--heartbeat-udp {}: {}", u, why));
      try {  // resolved now, before any start-up work
        udp = std::make_unique<UdpSender>(host, port);
      } catch (const Error& e) {
        throw UsageError(fmt::format("--heartbeat-udp {}: {}", u, e.what()));
      }
    }
    TrainConfig cfg = load_train_config(args->config, args->sets);
    if ((args->hang_rank >= 0) != (args->hang_step >= 0))
      throw UsageError("--inject-hang-rank and --inject-hang-step go together");
    MpiSession mpi;  // a world of one without a launcher
    for (const Fault& f : faults.faults)
      if (f.rank >= mpi.size())
        throw UsageError(fmt::format("--inject {}: rank {} is not in this run of {} rank{} (0-{})", f.spec, f.rank,
                                     mpi.size(), mpi.size() == 1 ? "" : "s", mpi.size() - 1));
    // --inject-hang-rank R --inject-hang-step S (S >= 1): hang@S:rR (S = 0 is handled below, at start-up)
    if (args->hang_step > 0) {
      Fault f;
      f.kind = Fault::Kind::kHang;
      f.first_step = f.last_step = args->hang_step;
      f.rank = args->hang_rank;
      f.spec = fmt::format("hang@{}:r{}", args->hang_step, args->hang_rank);
      faults.faults.push_back(f);
    }
    // SIGINT / SIGTERM (Ctrl-C, a preemption): the first stops the run at the next step boundary,
    // every rank at the same one, after saving a checkpoint there; a second exits at once.
    install_stop_signals();
    // SIGUSR2: the receiving thread's stack on stderr (keel run asks a hung rank's main thread)
    install_stack_dump();
    // A hung or dead peer blocks the others inside a collective forever: each phase below runs
    // under a deadline, so every surviving rank exits with one line instead (and the launcher
    // tears down the rest).
    Watchdog dog;
    // Every place training blocks on other ranks is a PeerWait (MPI collectives, GPU syncs), so
    // a timeout names the stuck rank: it is the one not waiting.
    if (mpi.size() > 1) dog.track_peer_waits();
    auto phase = [&](const std::string& what) {
      if (args->timeout > 0) dog.arm(what, args->timeout);
    };
    phase("start-up (config check, GPU binding)");
    if (args->hang_step == 0 && mpi.rank() == args->hang_rank) hang_forever();
    // --skip-step too: a rank skipping other data than its peers would train silently on another batch.
    require_same_config_on_every_rank(fmt::format("{}\n--resume: {}\n--stop-after: {}\n--skip-step: {}\n", cfg.text,
                                                  args->resume, args->until, fmt::join(args->skip_steps, ",")),
                                      mpi);
    parallel::Mesh mesh = make_mesh(cfg, mpi);
    dog.on_timeout([mesh]() mutable { mesh.abort_all(); });  // collectives stuck on a dead peer return
    phase("start-up (communicators, model initialization, data)");
    const auto started = std::chrono::steady_clock::now();
    Trainer t(cfg, mesh);
    t.watch_progress(&dog, args->timeout);
    t.set_faults(faults);
    if (!args->heartbeat.empty()) t.heartbeat_to(args->heartbeat);
    if (udp) t.heartbeat_udp_to(std::move(udp), udp_tag);
    t.skip_data_of(args->skip_steps);
    t.stop_when([] { return stop_signal(); });
    if (!args->resume.empty()) {
      phase(fmt::format("resuming from {}", args->resume));
      t.resume(args->resume);
    }
    const auto t0 = std::chrono::steady_clock::now();
    // Start-up (initialization or resume) is worth seeing: at billions of parameters it is
    // seconds to minutes that the step times do not show.
    const double startup_sec = std::chrono::duration<double>(t0 - started).count();
    const std::int64_t start = t.step();
    const auto stats = t.run(args->until, /*checkpoint_at_stop=*/true);
    dog.disarm();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (const int sig = t.stopped_by(); sig != 0) {  // a clean stop on a signal: 128 + its number, as a shell reports it
      set_exit_code(128 + sig);
      if (mpi.rank() != 0) return;
      const std::string saved = t.checkpoint_path(t.step());
      if (std::filesystem::exists(std::filesystem::path(saved) / "metadata.json"))
        std::printf("stopped on %s after step %lld of %lld: checkpoint %s; continue with --resume %s\n",
                    signal_name(sig), static_cast<long long>(t.step()), static_cast<long long>(cfg.steps),
                    saved.c_str(), cfg.checkpoint_dir.c_str());
      else if (t.step() == start)
        std::printf("stopped on %s at step %lld, before training: nothing new to save\n", signal_name(sig),
                    static_cast<long long>(t.step()));
      else
        std::printf("stopped on %s after step %lld of %lld: no checkpoint saved (this run saves none: "
                    "checkpoint.final is false and checkpoint.interval 0)\n",
                    signal_name(sig), static_cast<long long>(t.step()), static_cast<long long>(cfg.steps));
      std::fflush(stdout);
      return;
    }
    if (mpi.rank() != 0) return;  // rank 0 speaks for the group
    if (!stats.empty()) {
      std::printf("done: steps %lld -> %lld in %.1f s, loss %.4f -> %.4f (start-up %.1f s before the first step)\n",
                  static_cast<long long>(start), static_cast<long long>(t.step()), sec, stats.front().loss,
                  stats.back().loss, startup_sec);
      if (cfg.kernels.profile) {
        const ProfileReport report = t.backend().profile_report();
        std::printf("%s", format_profile(report).c_str());
        write_file_atomically((std::filesystem::path(cfg.output_dir) / "profile.json").string(), profile_json(report));
      }
    } else
      std::printf("done: nothing to do (step %lld of %lld)\n", static_cast<long long>(t.step()),
                  static_cast<long long>(cfg.steps));
  });
}

}  // namespace keel::train

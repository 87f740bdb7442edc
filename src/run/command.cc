#include "run/command.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <memory>

#include "common/error.h"
#include "common/process.h"
#include "device/cuda_devices.h"
#include "run/supervisor.h"

namespace keel::run {

void add_command(CLI::App& app) {
  auto o = std::make_shared<Options>();
  auto ranks = std::make_shared<int>(0);
  CLI::App* cmd = app.add_subcommand(
      "run", "Train through faults, unattended: launch `keel train`, watch it (dead or hung ranks, NaN), and restart "
             "it from its newest checkpoint until every step is done");
  cmd->add_option("config", o->config, "Training config (YAML), as keel train takes it")->required();
  cmd->add_option("--set", o->sets, "Override a config key (repeatable), as keel train's --set");
  cmd->add_option("--ranks", *ranks,
                  "Processes (default: one per visible GPU, else 1; under --launcher srun the allocation's "
                  "SLURM_NTASKS)");
  cmd->add_option("--launcher", o->launcher,
                  "How the ranks start: mpirun, or srun inside a Slurm allocation (a failing node is left out with "
                  "--exclude)")
      ->capture_default_str();
  cmd->add_option("--hosts", o->hosts,
                  "mpirun --hostfile for a job on several nodes (a failing node is left out of the next attempt's copy)");
  cmd->add_option("--max-restarts", o->max_restarts,
                  "Faults in a row to survive before giving up (an attempt that commits a newer checkpoint starts "
                  "the count again)")
      ->capture_default_str();
  cmd->add_option("--hang-factor", o->hang_factor,
                  "A rank is hung when its heartbeat is older than this many median step times")
      ->capture_default_str();
  cmd->add_option("--min-deadline", o->min_deadline, "The hang deadline's floor, seconds")->capture_default_str();
  cmd->add_option("--start-deadline", o->start_deadline,
                  "Seconds from launch to every rank's first heartbeat (start-up, resume) before it is a hang")
      ->capture_default_str();
  cmd->add_option("--straggler-factor", o->straggler.factor,
                  "A rank whose own work per step (its step time less its waits on the others) stays above this "
                  "many times the other ranks' is reported as a straggler (0: off)")
      ->capture_default_str();
  cmd->add_option("--straggler-steps", o->straggler.steps, "Steps in a row above that bar before it is reported")
      ->capture_default_str();
  cmd->add_option("--backoff", o->backoff, "Seconds before the first restart; doubles per restart in a row (reset by progress)")->capture_default_str();
  cmd->add_option("--backoff-max", o->backoff_max, "The back-off's ceiling, seconds")->capture_default_str();
  cmd->add_option("--grace", o->grace, "Seconds a stop signal gives the job to save and exit")->capture_default_str();
  cmd->add_option("--heartbeats", o->heartbeats,
                  "How the ranks' heartbeats reach keel run: files (a directory: /dev/shm on one node, the output "
                  "directory on several), udp (datagrams to a port keel run listens on), both, or auto (files on one "
                  "node, both on several)")
      ->check(CLI::IsMember({"auto", "files", "udp", "both"}))
      ->capture_default_str();
  cmd->add_option("--heartbeat-host", o->heartbeat_host,
                  "The name or address of this host that the ranks send heartbeat datagrams to (default: its host "
                  "name; 127.0.0.1 on one node)");
  cmd->add_option("--events", o->events, "Event log (JSONL; default: <output_dir>/run_events.jsonl)");
  cmd->add_option("--inject", o->inject,
                  "Fault injection (tests, soak runs): keel train --inject specs, e.g. kill@5:r1 (repeatable)");
  cmd->add_option("--train-arg", o->train_args, "One more keel train flag or value, passed as is (repeatable)");
  cmd->add_flag("--preflight", o->preflight.enabled,
                "Before each attempt, a short GEMM, memory-bandwidth and all-reduce benchmark on every rank; a rank "
                "below the others' median or a floor stops the job, named");
  cmd->add_option("--preflight-fraction", o->preflight.fraction,
                  "A rank fails the pre-flight below this fraction of the other ranks' median (GEMM, memory)")
      ->capture_default_str();
  cmd->add_flag("!--no-exclude", o->exclude,
                "With --preflight: stop the job when a rank fails the gate instead of taking its device out");
  cmd->add_flag("--exclude-stragglers", o->exclude_stragglers,
                "Take a straggler's device out of the job: it saves, stops, and resumes on the other ranks (the "
                "global batch kept; the device on the bad list)");
  auto floors = std::make_shared<std::string>();
  cmd->add_option("--preflight-floor", *floors, "Pre-flight floors: gemm=TFLOPS,mem=GBPS,comm=GBPS (any of them)");
  cmd->callback([o, ranks, floors] {
    if (!floors->empty()) parse_preflight_floors(*floors, o->preflight);
    if (!(std::isfinite(o->preflight.fraction) && o->preflight.fraction > 0 && o->preflight.fraction <= 1))
      throw UsageError(fmt::format("--preflight-fraction {}: must be in (0, 1]", o->preflight.fraction));
    if (launched_as_rank())
      throw UsageError("run: keel run is the supervisor, not a rank: start it once, not under mpirun or srun");
    if (*ranks < 0) throw UsageError(fmt::format("--ranks {}: must be >= 1", *ranks));
    if (o->launcher != "mpirun" && o->launcher != "srun")
      throw UsageError(fmt::format("--launcher {}: must be mpirun or srun", o->launcher));
    if (o->launcher == "srun" && !o->hosts.empty())
      throw UsageError(fmt::format("--hosts {}: srun runs on the Slurm allocation's nodes; --hosts is mpirun's",
                                   o->hosts));
    const char* ntasks = std::getenv("SLURM_NTASKS");
    if (*ranks > 0) o->ranks = *ranks;
    else if (o->launcher == "srun" && ntasks && std::atoi(ntasks) > 0) o->ranks = std::atoi(ntasks);
    else o->ranks = std::max(1, visible_cuda_devices());
    if (o->max_restarts < 0) throw UsageError(fmt::format("--max-restarts {}: must be >= 0", o->max_restarts));
    for (const auto& [v, name] : {std::pair{o->hang_factor, "--hang-factor"}, std::pair{o->min_deadline, "--min-deadline"},
                                  std::pair{o->start_deadline, "--start-deadline"}, std::pair{o->backoff, "--backoff"},
                                  std::pair{o->backoff_max, "--backoff-max"}, std::pair{o->grace, "--grace"}})
      if (!(std::isfinite(v) && v >= 0)) throw UsageError(fmt::format("{} {}: must be a number >= 0", name, v));
    if (o->hang_factor < 1) throw UsageError(fmt::format("--hang-factor {}: must be >= 1", o->hang_factor));
    if (!(std::isfinite(o->straggler.factor) && (o->straggler.factor == 0 || o->straggler.factor > 1)))
      throw UsageError(fmt::format("--straggler-factor {}: must be above 1 (or 0: off)", o->straggler.factor));
    if (o->straggler.steps < 1)
      throw UsageError(fmt::format("--straggler-steps {}: must be >= 1", o->straggler.steps));
    set_exit_code(run(*o));
  });
}

}  // namespace keel::run

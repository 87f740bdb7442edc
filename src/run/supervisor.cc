#include "run/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "ckpt/store.h"
#include "ckpt/tools.h"
#include "common/error.h"
#include "common/faults.h"
#include "common/host.h"
#include "common/stack_dump.h"
#include "common/udp.h"
#include "device/cuda_devices.h"
#include "run/child.h"
#include "run/nodes.h"
#include "train/train_config.h"

namespace keel::run {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::atomic<int> g_stop{0};
extern "C" void on_stop(int sig) { g_stop.store(sig); }

std::string self_exe() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) fail("run: cannot find the keel binary (/proc/self/exe: {})", ec.message());
  return p.string();
}

// One rank's last heartbeat (keel train --heartbeat).
struct Beat {
  int rank = -1, pid = 0, world = 0;
  std::int64_t step = 0;
  double time = 0, step_seconds = 0, wait_seconds = 0;
  double device_seconds = 0;  // the device canary's time (GPUs; 0: none)
  std::string phase, host;
  std::string gpu;  // the rank's GPU ("cuda:N <PCI bus id>"; empty on CPU ranks)
};

// A heartbeat's JSON (keel train's file or datagram); rank -1 when it is not one.
Beat beat_of(const nlohmann::json& j) {
  Beat b;
  if (!j.is_object()) return b;
  b.rank = j.value("rank", -1), b.pid = j.value("pid", 0), b.world = j.value("world", 0);
  b.step = j.value("step", std::int64_t{0});
  b.time = j.value("time", 0.0), b.step_seconds = j.value("step_seconds", 0.0);
  b.wait_seconds = j.value("wait_seconds", 0.0);
  b.device_seconds = j.value("device_seconds", 0.0);
  b.phase = j.value("phase", std::string()), b.host = j.value("host", std::string());
  b.gpu = j.value("gpu", std::string());
  return b;
}

std::map<int, Beat> read_beats(const fs::path& dir) {
  std::map<int, Beat> out;
  if (dir.empty()) return out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("rank-") || !name.ends_with(".json")) continue;
    std::ifstream f(e.path());
    const Beat b = beat_of(nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false));
    if (b.rank >= 0) out[b.rank] = b;  // (a file being replaced does not parse: read it next time)
  }
  return out;
}

// The heartbeats that came as datagrams (keel train --heartbeat-udp): each rank's newest of
// this attempt (tag), kept across polls; merged over the files' by time.
struct UdpBeats {
  std::unique_ptr<UdpReceiver> socket;
  std::string tag;
  std::map<int, Beat> last;
  void start(std::string attempt_tag) { tag = std::move(attempt_tag), last.clear(); }
  std::map<int, Beat> merged(std::map<int, Beat> beats) {
    if (!socket) return beats;
    for (const std::string& text : socket->drain()) {
      const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      const Beat b = beat_of(j);
      // an earlier attempt's rank (on another host, still going down) says so by its tag
      if (b.rank < 0 || j.value("tag", std::string()) != tag) continue;  // (rank -1: no JSON object)
      if (auto it = last.find(b.rank); it == last.end() || it->second.time <= b.time) last[b.rank] = b;
    }
    for (const auto& [r, b] : last)
      if (auto it = beats.find(r); it == beats.end() || it->second.time < b.time) beats[r] = b;
    return beats;
  }
};

// The step `latest` of a checkpoint root names (0 without one).
std::int64_t latest_step(const std::string& root) {
  const std::string dir = ckpt::latest_dir(root);
  if (dir.empty()) return 0;
  std::int64_t step = 0;
  return ckpt::parse_step_dir_name(fs::path(dir).filename().string(), &step) ? step : 0;
}

// The newest committed checkpoint that verifies (ckpt::verify_checkpoint: sizes, CRCs, coverage,
// a whole train state) made `latest`, its step returned (0: none). A newer one that does not
// verify (a torn or truncated file) is moved aside to ROOT/corrupt_step_N (keel never lists or
// removes that name) and recorded, and `latest` is pointed at the previous committed step.
template <typename Log>
std::int64_t usable_latest(const std::string& root, Log& events) {
  for (;;) {
    std::string dir;
    try {
      dir = ckpt::latest_dir(root);
    } catch (const Error&) {
    }
    if (dir.empty()) return 0;
    const std::int64_t step = latest_step(root);
    const auto t0 = std::chrono::steady_clock::now();
    const ckpt::VerifyResult v = ckpt::verify_checkpoint(dir);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (v.problems.empty()) {
      std::printf("keel run: %s verifies (%.2f GiB of shards, their checksums in %.1f s)\n",
                  fs::path(dir).filename().c_str(), static_cast<double>(v.bytes) / (1ull << 30), seconds);
      events.write({{"event", "verified"}, {"step", step}, {"bytes", v.bytes}, {"seconds", seconds}});
      return step;
    }
    const fs::path aside = fs::path(root) / fmt::format("corrupt_{}", fs::path(dir).filename().string());
    std::error_code ec;
    fs::remove_all(aside, ec);
    fs::rename(dir, aside, ec);
    if (ec) fail("run: the checkpoint {} does not verify ({}) and cannot be moved aside: {}", dir, v.problems.front(),
                 ec.message());
    std::string previous;
    for (const auto& e : ckpt::list_steps(root))
      if (e.committed && e.step < step) previous = fs::path(e.dir).filename().string();
    if (previous.empty())
      fs::remove(fs::path(root) / "latest", ec);
    else
      ckpt::commit_file((fs::path(root) / "latest").string(), previous + "\n");
    std::printf("keel run: checkpoint %s does not verify (%s): moved to %s; `latest` is now %s\n", dir.c_str(),
                v.problems.front().c_str(), aside.string().c_str(), previous.empty() ? "none" : previous.c_str());
    events.write({{"event", "corrupt_checkpoint"}, {"step", step}, {"problem", v.problems.front()},
                  {"moved_to", aside.string()}, {"latest", previous}});
  }
}

class EventLog {
 public:
  explicit EventLog(const std::string& path) : path_(path) {
    std::error_code ec;
    fs::create_directories(fs::path(path).parent_path(), ec);
  }
  void write(nlohmann::json j) {
    j["time"] = unix_now();
    std::ofstream f(path_, std::ios::app);
    f << j.dump() << "\n";
  }

 private:
  std::string path_;
};

// One attempt: the child process (the launcher, or keel train itself) in its own process group,
// its output copied to stdout and to the attempt's log.
struct Child {
  pid_t pid = -1;
  int out = -1;  // read end of its stdout + stderr
};

Child spawn(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe(fds) != 0) fail("run: pipe: {}", std::strerror(errno));
  const pid_t pid = fork_exec(argv, fds[1], fds[0]);
  close(fds[1]);
  fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  return {pid, fds[0]};
}

struct Fault {
  std::string kind;  // dead, hang, nan, loss_spike, disk_full, exit
  int rank = -1, pid = 0;
  std::string host, gpu;  // gpu: from the rank's heartbeat (empty: a CPU rank, or not known)
  std::int64_t step = 0;  // the last step every rank finished
  double detect_seconds = 0;
  std::string detail;
  std::int64_t skip_step = 0;  // nan, loss_spike: the step whose data is skipped on restart
  nlohmann::json numbers = nlohmann::json::object();  // loss_spike: loss, mean, std (into the event)
  std::vector<std::string> threads;                    // hang: what each local rank's threads wait in
};

}  // namespace

std::string heartbeat_dir(const std::string& output_dir, bool multi_node, const std::string& local_root) {
  std::error_code ec;
  if (!multi_node && !local_root.empty() && fs::is_directory(local_root, ec) && ::access(local_root.c_str(), W_OK) == 0)
    return (fs::path(local_root) / fmt::format("keel-run-{}", ::getpid())).string();
  return (fs::path(output_dir) / ".heartbeat").string();
}

int run(const Options& o) {
  const train::TrainConfig cfg = train::load_train_config(o.config, o.sets);
  const std::string ckpt_root = cfg.checkpoint_dir.empty() ? cfg.output_dir : cfg.checkpoint_dir;
  if (cfg.checkpoint_interval <= 0)
    std::fprintf(stderr, "keel: warning: run: checkpoint.interval is 0: a fault restarts the run from its start "
                         "(or from the checkpoint it resumed)\n");
  const fs::path out_dir = cfg.output_dir;
  EventLog events(o.events.empty() ? (out_dir / "run_events.jsonl").string() : o.events);
  const std::string exe = self_exe();
  std::signal(SIGINT, on_stop);
  std::signal(SIGTERM, on_stop);

  const auto wall0 = Clock::now();
  std::vector<std::int64_t> skips;
  // the injected faults, one by one (common/faults.h parses them here as keel train does: a bad
  // spec is one line before any launch)
  std::vector<keel::Fault> pending, health;  // keel train's; keel run's own pre-flight ones
  for (const auto& spec : o.inject)
    for (const keel::Fault& f : parse_faults(spec).faults) (f.kind == keel::Fault::Kind::kHealth ? health : pending).push_back(f);
  const bool cuda = cfg.device == "cuda" || (cfg.device == "auto" && visible_cuda_devices() > 0);
  std::map<std::string, int> survived;
  double useful = 0;  // seconds of the steps kept
  int restarts = 0;
  int in_a_row = 0;  // restarts since an attempt last committed a newer checkpoint (--max-restarts, the back-off)
  std::string last_startup_error;  // the previous attempt's error before its first step
  // The devices taken out of the job: the bad list of earlier invocations, and this one's.
  const std::string bad_list = (out_dir / "run_excluded.json").string();
  std::vector<Excluded> excluded = load_excluded(bad_list);
  const std::string this_host = host_name();
  std::vector<std::string> gpu_ids;  // this node's GPUs as keel run found them
  if (cuda) {
    const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
    if (env && *env) {
      std::stringstream ss(env);
      for (std::string id; std::getline(ss, id, ',');) gpu_ids.push_back(id);
    } else {
      for (int i = 0; i < visible_cuda_devices(); ++i) gpu_ids.push_back(std::to_string(i));
    }
  }
  // Applies the bad list: the ranks left, CUDA_VISIBLE_DEVICES without the excluded GPUs, and
  // the layout's data degree for them (empty when it divides as configured). Throws when the
  // job cannot run on what is left.
  int ranks = o.ranks;
  std::vector<std::string> ids = gpu_ids;  // the GPUs the job's ranks use, in rank order
  // Why the job cannot run on n ranks of this node (empty: it can): the model axes must divide
  // them, and the global batch (batch.grad_accum) the data ranks left.
  const int model_ranks =
      std::max(1, cfg.parallel_tensor) * std::max(1, cfg.parallel_context) * std::max(1, cfg.parallel_tsp);
  const auto cannot_run_on = [&](int n) -> std::string {
    const int dp = n / model_ranks;
    if (n < 1) return "no rank is left";
    if (n % model_ranks != 0) return fmt::format("{} ranks do not hold tensor x context x tsp = {}", n, model_ranks);
    if (cfg.grad_accum % dp != 0)
      return fmt::format("batch.grad_accum ({}) does not split over {} data ranks (the global batch is kept)",
                         cfg.grad_accum, dp);
    if (dp % std::max(1, cfg.parallel_expert) != 0)
      return fmt::format("parallel.expert ({}) does not divide {} data ranks", cfg.parallel_expert, dp);
    return "";
  };
  std::vector<std::string> shrink_sets;
  // Several nodes (--hosts, srun): a failing device takes its node out; the launch leaves the
  // excluded nodes out (nodes.h).
  const bool multi_node = !o.hosts.empty() || o.launcher == "srun";
  // Heartbeats: files (a directory every node sees), datagrams to this keel run (several nodes:
  // a shared file system can hold a file back behind a checkpoint's writes), or both.
  const std::string beat_mode = o.heartbeats == "auto" ? (multi_node ? "both" : "files") : o.heartbeats;
  const bool beat_files = beat_mode != "udp";
  UdpBeats udp;
  std::string udp_host;
  if (beat_mode != "files") {
    udp.socket = std::make_unique<UdpReceiver>(0);
    udp_host = !o.heartbeat_host.empty() ? o.heartbeat_host : multi_node ? host_name() : "127.0.0.1";
    try {  // the name must resolve here at least (the ranks resolve it again where they run)
      UdpSender probe(udp_host, udp.socket->port());
    } catch (const Error& e) {
      if (beat_mode == "udp" || !o.heartbeat_host.empty())
        throw UsageError(fmt::format("--heartbeat-host {}: {}", udp_host, e.what()));
      std::printf("keel run: heartbeat datagrams off (%s); the heartbeat files carry them\n", e.what());
      udp.socket.reset();
    }
  }
  const fs::path beats_dir = beat_files ? fs::path(heartbeat_dir(out_dir.string(), multi_node)) : fs::path();
  const auto current_beats = [&] { return udp.merged(read_beats(beats_dir)); };
  struct RemoveLocal {  // a node-local heartbeat directory goes with this keel run
    fs::path dir;
    ~RemoveLocal() {
      std::error_code ec;
      if (!dir.empty()) fs::remove_all(dir, ec);
    }
  } remove_local{beats_dir.empty() || beats_dir == heartbeat_dir(out_dir.string(), true) ? fs::path() : beats_dir};
  if (!o.hosts.empty()) read_hostfile(o.hosts);  // one line now when it cannot be read
  std::vector<std::string> nodes_out;  // excluded nodes, in order
  std::string hostfile = o.hosts;      // the next attempt's (without them)
  const char* const unit = multi_node ? "node" : "device";  // what an exclusion takes out
  int units_out = 0;                                          // how many, as applied
  const auto apply_excluded = [&] {
    int gone = 0;  // ranks leaving
    units_out = 0;
    if (multi_node) {
      nodes_out.clear();
      for (const auto& e : excluded) {
        if (std::find(nodes_out.begin(), nodes_out.end(), e.host) != nodes_out.end()) continue;
        if (e.ranks <= 0)
          throw Error(fmt::format("run: the bad list {} names a device of host {} (from a job on one node); a job on "
                                  "several nodes takes whole nodes out: move the bad list aside",
                                  bad_list, e.host));
        nodes_out.push_back(e.host);
        gone += e.ranks, ++units_out;
      }
    } else {
      ids = gpu_ids;
      for (const auto& e : excluded) {
        if (e.host != this_host) continue;
        if (!e.gpu.empty()) {
          const auto it = std::find(ids.begin(), ids.end(), e.gpu);
          if (it == ids.end()) continue;
          ids.erase(it);
        }
        ++gone, ++units_out;
      }
    }
    if (units_out == 0) return;
    ranks = o.ranks - gone;
    if (!multi_node && cuda) ranks = std::min(ranks, static_cast<int>(ids.size()));
    const std::string why = cannot_run_on(ranks);
    if (!why.empty())
      throw Error(fmt::format("run: without the {} excluded {}(s) (bad list {}) the job cannot run: {}; move the bad "
                              "list aside or change the layout",
                              units_out, unit, bad_list, why));
    shrink_sets = {"parallel.data=" + std::to_string(ranks / model_ranks)};
    if (multi_node && !o.hosts.empty()) {
      hostfile = (out_dir / "run_hostfile").string();
      write_hostfile_without(o.hosts, nodes_out, hostfile);
    } else if (!multi_node && cuda) {
      std::string list;
      for (const auto& id : ids) list += (list.empty() ? "" : ",") + id;
      setenv("CUDA_VISIBLE_DEVICES", list.c_str(), 1);
    }
  };
  // An exclusion of rank r (host, device): its node on several nodes (with the node's ranks),
  // else its device (its GPU id on GPUs).
  const auto exclusion_of = [&](int r, const std::string& host, const std::string& device, const std::string& reason,
                                int attempt, int node_ranks) {
    return Excluded{host, !multi_node && cuda && r < static_cast<int>(ids.size()) ? ids[static_cast<std::size_t>(r)] : "",
                    device, reason, attempt, multi_node ? node_ranks : 0};
  };
  apply_excluded();
  if (ranks != o.ranks)
    std::printf("keel run: %d %s(s) on the bad list %s: the job runs on %d rank%s\n", units_out, unit, bad_list.c_str(),
                ranks, ranks == 1 ? "" : "s");
  events.write({{"event", "start"}, {"config", o.config}, {"ranks", ranks}, {"steps", cfg.steps}});
  double fault_at = -1;  // when keel run declared the last fault (unix seconds): the restart time's start
  for (int attempt = 1;; ++attempt) {
    const std::int64_t resume = usable_latest(ckpt_root, events);
    std::error_code ec;
    if (beat_files) {
      fs::remove_all(beats_dir, ec);
      fs::create_directories(beats_dir, ec);
    }
    std::vector<std::string> argv = launch_args(o.launcher, ranks, hostfile, nodes_out);
    if (o.preflight.enabled) {
      std::vector<int> injected;
      for (const auto& f : health)
        if (f.first_step == attempt) injected.push_back(f.rank);
      const Preflight p = run_preflight(exe, argv, ranks, (out_dir / "preflight" / fmt::format("attempt_{}", attempt)).string(),
                                        cuda, injected, o.preflight);
      events.write(preflight_event(p, attempt));
      std::printf("keel run: pre-flight: %d rank%s, GEMM median %.3g TFLOP/s, memory median %.3g GB/s%s (%.1f s)\n",
                  ranks, ranks == 1 ? "" : "s", p.gemm_median, p.mem_median,
                  ranks > 1 ? fmt::format(", all-reduce {:.3g} GB/s", p.comm_busbw).c_str() : "", p.seconds);
      for (const auto& f : p.failures) std::printf("keel run: pre-flight: FAILED %s\n", f.c_str());
      std::fflush(stdout);
      if (!p.failures.empty()) {
        // the ranks' devices out of the job, on the bad list; or a stop (nothing lost)
        const bool shrink = o.exclude && !p.failed_ranks.empty() && !p.comm_failed;
        if (!shrink) {
          events.write({{"event", "give_up"}, {"restarts", restarts}, {"last_fault", "preflight"}, {"detail", p.failures.front()}});
          throw Error(fmt::format("run: the pre-flight health gate failed before attempt {}: {}{}; {} (nothing was "
                                  "lost: the checkpoints stay)",
                                  attempt, p.failures.front(),
                                  p.failures.size() > 1 ? fmt::format(" (and {} more)", p.failures.size() - 1) : "",
                                  !o.exclude ? "--no-exclude: stopping" : "not a rank's device: stopping"));
        }
        std::map<std::string, int> on_host;  // ranks per node, as the gate found them
        for (const RankHealth& h : p.ranks) ++on_host[h.host];
        for (int r : p.failed_ranks) {
          const RankHealth& h = p.ranks[static_cast<std::size_t>(r)];
          if (multi_node && std::any_of(excluded.begin(), excluded.end(),
                                        [&](const Excluded& x) { return x.host == h.host && x.attempt == attempt; }))
            continue;  // its node is out already
          Excluded e = exclusion_of(r, h.host, h.device, "", attempt, on_host[h.host]);
          for (const auto& f : p.failures)
            if (f.rfind(fmt::format("rank {} ", r), 0) == 0) e.reason += (e.reason.empty() ? "" : "; ") + f;
          excluded.push_back(e);
          events.write({{"event", "exclude"}, {"attempt", attempt}, {"rank", r}, {"host", e.host}, {"gpu", e.gpu},
                        {"device", e.device}, {"reason", e.reason}, {"node_ranks", e.ranks}});
          if (multi_node)
            std::printf("keel run: excluding node %s (%d rank%s): rank %d failed the pre-flight gate\n", e.host.c_str(),
                        e.ranks, e.ranks == 1 ? "" : "s", r);
          else
            std::printf("keel run: excluding rank %d's device (host %s%s): it failed the pre-flight gate\n", r,
                        e.host.c_str(), e.gpu.empty() ? "" : fmt::format(", GPU {}", e.gpu).c_str());
        }
        save_excluded(bad_list, excluded);
        apply_excluded();
        std::printf("keel run: the job goes on with %d rank%s (parallel.data %s, the global batch kept); the bad "
                    "list is %s\n",
                    ranks, ranks == 1 ? "" : "s", shrink_sets.front().substr(14).c_str(), bad_list.c_str());
        std::fflush(stdout);
        continue;
      }
    }
    argv.insert(argv.end(), {exe, "train", o.config});
    if (beat_files) argv.insert(argv.end(), {"--heartbeat", beats_dir.string()});
    if (udp.socket) {
      udp.start(std::to_string(attempt));
      argv.insert(argv.end(), {"--heartbeat-udp", fmt::format("{}:{}/{}", udp_host, udp.socket->port(), attempt)});
    }
    for (const auto& s : o.sets) argv.insert(argv.end(), {"--set", s});
    for (const auto& s : shrink_sets) argv.insert(argv.end(), {"--set", s});
    // a restart resumes, also from step 0 when nothing was committed yet: keel train's --resume of
    // its own directory starts it over there (a plain start refuses the earlier attempt's metrics)
    if (resume > 0 || attempt > 1) argv.insert(argv.end(), {"--resume", ckpt_root});
    for (std::int64_t s : skips) argv.insert(argv.end(), {"--skip-step", std::to_string(s)});
    for (const auto& f : pending)  // (not those of a rank taken out: the ranks left are fewer)
      if (f.rank < ranks) argv.insert(argv.end(), {"--inject", f.spec});
    argv.insert(argv.end(), o.train_args.begin(), o.train_args.end());
    std::printf("keel run: attempt %d%s\n", attempt,
                resume > 0 ? fmt::format(", resuming from step {}", resume).c_str() : ", from the start");
    std::fflush(stdout);
    const std::string log_path = (out_dir / fmt::format("run_attempt_{}.log", attempt)).string();
    fs::create_directories(out_dir, ec);
    std::ofstream log(log_path);
    const auto t_start = Clock::now();
    Child child = spawn(argv);

    std::deque<std::string> tail;  // the attempt's last lines
    std::string partial;
    auto drain = [&] {
      char buf[65536];
      for (;;) {
        const ssize_t n = read(child.out, buf, sizeof buf);
        if (n <= 0) break;
        std::fwrite(buf, 1, static_cast<std::size_t>(n), stdout);
        log.write(buf, n);
        partial.append(buf, static_cast<std::size_t>(n));
        for (std::size_t nl; (nl = partial.find('\n')) != std::string::npos;) {
          tail.push_back(partial.substr(0, nl));
          partial.erase(0, nl + 1);
          if (tail.size() > 400) tail.pop_front();
        }
      }
      std::fflush(stdout);
      log.flush();
    };
    auto kill_job = [&](const std::map<int, Beat>& beats) {
      kill(-child.pid, SIGTERM);
      for (const auto& [r, b] : beats)
        if (b.pid > 0) kill(b.pid, SIGKILL);  // a hung rank does not answer SIGTERM
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      kill(-child.pid, SIGKILL);
    };

    std::optional<Fault> fault;
    int status = 0;
    bool exited = false, stopping = false;
    std::optional<Excluded> straggler_out;  // --exclude-stragglers: the device leaving after this attempt
    int straggler_rank = -1;
    Clock::time_point stop_at{};
    std::vector<double> step_times;
    std::int64_t seen_step = resume;
    std::map<int, Beat> beats;
    // the attempt's start-up, itemised once: launch to every rank's first beat (start-up and
    // resume), then to the first step any rank finished
    double all_started_after = -1;
    bool first_step_seen = false;
    // SIGTERM to the ranks on this host (a launcher that gets it aborts the job instead of letting
    // the ranks finish their save; keel train passes a stop on to every rank), or to the job's
    // group when none is (yet) known here
    const auto ask_to_stop = [&](const std::map<int, Beat>& known) {
      bool told = false;
      for (const auto& [r, b] : known)
        if (b.pid > 0 && b.host == this_host) told |= kill(b.pid, SIGTERM) == 0;
      if (!told) kill(-child.pid, SIGTERM);
    };
    StragglerWatch stragglers(o.straggler);
    StragglerOptions device_options = o.straggler;
    device_options.min_gap = 0;     // the canary takes about 0.2 ms: the factor alone
    device_options.fastest = true;  // its best time of the window (straggler.h)
    StragglerWatch device_stragglers(device_options);
    while (!exited) {
      std::this_thread::sleep_for(std::chrono::duration<double>(o.poll));
      drain();
      if (waitpid(child.pid, &status, WNOHANG) == child.pid) {
        exited = true;
        break;
      }
      if (const int sig = g_stop.load(); sig != 0 && !stopping) {
        stopping = true, stop_at = Clock::now();
        std::printf("keel run: signal %d: the job saves at its next step and stops\n", sig);
        ask_to_stop(current_beats());
      }
      if (stopping) {
        if (std::chrono::duration<double>(Clock::now() - stop_at).count() > o.grace) kill_job(current_beats());
        continue;
      }
      beats = current_beats();
      const double now = unix_now();
      if (!first_step_seen && !beats.empty()) {
        const double since_launch = std::chrono::duration<double>(Clock::now() - t_start).count();
        const int world = beats.begin()->second.world;
        if (all_started_after < 0 && world > 0 && static_cast<int>(beats.size()) >= world)
          all_started_after = since_launch;
        if (std::any_of(beats.begin(), beats.end(), [&](const auto& rb) { return rb.second.step > resume; })) {
          first_step_seen = true;
          const double restart = fault_at < 0 ? -1 : now - fault_at;
          fault_at = -1;  // once: a later restart without a fault (a straggler taken out) has none
          std::printf("keel run: attempt %d's first step %.1f s after its launch (every rank started in %s)%s\n",
                      attempt, since_launch,
                      all_started_after < 0 ? "-" : fmt::format("{:.1f} s", all_started_after).c_str(),
                      restart < 0 ? "" : fmt::format(", {:.1f} s after the fault", restart).c_str());
          std::fflush(stdout);
          events.write({{"event", "first_step"}, {"attempt", attempt}, {"seconds", since_launch},
                        {"started_seconds", all_started_after}, {"restart_seconds", restart}});
        }
      }
      // step times: every rank reports its last; the median over the attempt's steps so far
      if (!beats.empty())
        if (const Beat& b = beats.begin()->second; b.step > seen_step && b.step_seconds > 0) {
          seen_step = b.step;
          step_times.push_back(b.step_seconds);
        }
      // a straggler: reported, and the job goes on; with --exclude-stragglers its device (or
      // node) out of the job, which saves at its next step and resumes on the others (when it
      // can run on them). Two watches: the rank's own work per step (host-side slowness) and, on
      // GPUs, its device canary (a GPU's own slowness, which the step times cannot show).
      const auto straggled = [&](int r, const Beat& b, const std::string& kind, const std::string& what) {
        const std::string gpu = b.gpu.empty() ? "" : ", GPU " + b.gpu;
        std::printf("keel run: rank %d (host %s, pid %d%s) is a %sstraggler: %s, %d steps in a row\n", r,
                    b.host.c_str(), b.pid, gpu.c_str(), kind == "device" ? "GPU " : "", what.c_str(), o.straggler.steps);
        std::fflush(stdout);
        if (!o.exclude_stragglers || stopping || !(multi_node || b.host == this_host)) return false;
        int node_ranks = 0;  // several nodes: its node's ranks leave with it
        if (multi_node)
          for (const auto& [q, qb] : beats) node_ranks += qb.host == b.host ? 1 : 0;
        const std::string why = cannot_run_on(ranks - (multi_node ? node_ranks : 1));
        if (!why.empty()) {
          std::printf("keel run: the straggler stays: without it %s\n", why.c_str());
          return false;
        }
        straggler_out = exclusion_of(r, b.host, "", fmt::format("rank {} straggled: {}", r, what), attempt, node_ranks);
        straggler_rank = r;
        stopping = true, stop_at = Clock::now();
        std::printf("keel run: taking rank %d's %s out: the job saves at its next step and resumes without it\n", r,
                    multi_node ? fmt::format("node ({})", b.host).c_str() : "device");
        std::fflush(stdout);
        ask_to_stop(beats);
        return true;
      };
      for (const auto& [r, b] : beats) {
        if (b.phase != "step") continue;
        if (const auto x = stragglers.add(r, b.step, b.step_seconds, b.wait_seconds, b.world)) {
          events.write({{"event", "straggler"}, {"kind", "host"}, {"rank", r}, {"host", b.host}, {"pid", b.pid},
                        {"gpu", b.gpu}, {"step", x->step}, {"busy_seconds", x->busy}, {"others_busy_seconds", x->others},
                        {"window_seconds", x->window}});
          if (straggled(r, b, "host",
                        fmt::format("{:.3f} s of its own work per step against {:.3f} s for the other ranks, to step {}",
                                    x->busy, x->others, x->step)))
            break;
        }
        if (b.device_seconds <= 0) continue;
        if (const auto x = device_stragglers.add(r, b.step, b.device_seconds, 0.0, b.world)) {
          events.write({{"event", "straggler"}, {"kind", "device"}, {"rank", r}, {"host", b.host}, {"pid", b.pid},
                        {"gpu", b.gpu}, {"step", x->step}, {"device_seconds", x->busy},
                        {"others_device_seconds", x->others},
                        {"window_seconds", x->window}});
          if (straggled(r, b, "device",
                        fmt::format("its device takes {:.3f} ms for the canary against {:.3f} ms on the other "
                                    "ranks' devices, to step {}",
                                    1e3 * x->busy, 1e3 * x->others, x->step)))
            break;
        }
      }
      // a rank whose process is gone (same host: its pid)
      for (const auto& [r, b] : beats)
        if (b.pid > 0 && b.phase != "done" && b.host == this_host && kill(b.pid, 0) != 0 && errno == ESRCH) {
          Fault f;
          f.kind = "dead", f.rank = r, f.pid = b.pid, f.host = b.host, f.gpu = b.gpu, f.step = b.step;
          f.detect_seconds = o.poll;  // within one poll of its exit
          f.detail = "its process is gone";
          fault = f;
          break;
        }
      if (fault) {
        kill_job(beats);
        break;
      }
      // a hung rank: the oldest heartbeat against the adaptive deadline
      const double since_start = std::chrono::duration<double>(Clock::now() - t_start).count();
      const int world = beats.empty() ? 0 : beats.begin()->second.world;
      const bool all_started = world > 0 && static_cast<int>(beats.size()) >= world;
      if (!all_started) {
        if (since_start > o.start_deadline) {
          Fault f;
          f.kind = "hang", f.step = resume, f.detect_seconds = since_start;
          f.detail = fmt::format("{} of {} ranks started within {} s", beats.size(), std::max(world, ranks),
                                 o.start_deadline);
          fault = f;
          kill_job(beats);
          break;
        }
        continue;
      }
      const double deadline = step_times.empty() ? o.start_deadline
                                                 : std::max(o.min_deadline, o.hang_factor * median_of(step_times));
      const Beat* oldest = nullptr;
      for (const auto& [r, b] : beats)
        if (b.phase != "done" && (!oldest || b.time < oldest->time)) oldest = &b;
      if (oldest && now - oldest->time > deadline) {
        Fault f;
        f.kind = "hang", f.rank = oldest->rank, f.pid = oldest->pid, f.host = oldest->host, f.gpu = oldest->gpu;
        f.step = oldest->step;
        f.detect_seconds = now - oldest->time;
        f.detail = fmt::format("no heartbeat for {:.1f} s (deadline {:.1f} s: {} x the median step {:.3f} s, at least {} s)",
                               f.detect_seconds, deadline, o.hang_factor, median_of(step_times), o.min_deadline);
        // before the kill: what this host's ranks were waiting in (a stalled write, a lock, a
        // driver call or a spinning collective tell a slow disk from a hung peer)
        for (const auto& [r, b] : beats)
          if (b.pid > 0 && b.host == this_host)
            f.threads.push_back(fmt::format("rank {} (pid {}): {}", r, b.pid, describe_threads(thread_states(b.pid), b.pid)));
        // and each one's main thread writes its own stack into the attempt's log (SIGUSR2), one
        // rank at a time so that their lines do not interleave
        for (const auto& [r, b] : beats)
          if (b.pid > 0 && b.host == this_host && ::syscall(SYS_tgkill, b.pid, b.pid, kStackDumpSignal) == 0) {
            std::this_thread::sleep_for(std::chrono::milliseconds(o.stack_wait_ms));
            drain();
          }
        fault = f;
        kill_job(beats);
        break;
      }
    }
    if (!exited) waitpid(child.pid, &status, 0);
    drain();
    if (!partial.empty()) tail.push_back(partial);
    close(child.out);
    beats = current_beats();
    // The launcher is gone; its ranks on this host may not be yet (a rank killed while a kernel
    // of its spins on a peer tears its device context down for seconds, its output directory's
    // lock and its GPU memory held), nor those on other hosts: the next attempt starts once this
    // host's rank processes are gone and the directories' locks are free.
    double ranks_exit_seconds = 0;
    {
      std::vector<pid_t> local;
      for (const auto& [r, b] : beats)
        if (b.pid > 0 && b.host == this_host) local.push_back(b.pid);
      const auto t0 = Clock::now();
      const std::vector<pid_t> left = wait_gone(local, o.exit_wait);
      if (!left.empty())
        std::printf("keel run: %zu rank process%s of this attempt (pid %s) still there %.0f s after the job ended; "
                    "the next attempt may find the output directory locked\n",
                    left.size(), left.size() == 1 ? "" : "es", fmt::format("{}", fmt::join(left, ", ")).c_str(),
                    o.exit_wait);
      for (const std::string& dir : {cfg.output_dir, ckpt_root}) {
        const double budget = std::max(1.0, o.exit_wait - std::chrono::duration<double>(Clock::now() - t0).count());
        const std::string holder = wait_unlocked(dir, budget);
        if (!holder.empty())
          std::printf("keel run: %s is still locked by %s; the next attempt may be refused\n", dir.c_str(),
                      holder.c_str());
      }
      ranks_exit_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      if (ranks_exit_seconds >= 1.0)
        std::printf("keel run: the attempt's ranks had let go %.1f s after the job ended\n", ranks_exit_seconds);
      std::fflush(stdout);
    }
    std::int64_t reached = resume;
    bool done = !beats.empty();
    for (const auto& [r, b] : beats) {
      reached = std::max(reached, b.step);
      done = done && b.phase == "done";
    }
    const double attempt_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!fault && clean && done && reached >= cfg.steps) {
      useful += median_of(step_times) * static_cast<double>(reached - resume);
      const double wall = std::chrono::duration<double>(Clock::now() - wall0).count();
      int total = 0;
      nlohmann::json by_kind = nlohmann::json::object();
      for (const auto& [k, n] : survived) by_kind[k] = n, total += n;
      const double ratio = wall > 0 ? useful / wall : 0;
      events.write({{"event", "done"}, {"steps", cfg.steps}, {"attempts", attempt}, {"faults_survived", total},
                    {"by_kind", by_kind}, {"wall_seconds", wall}, {"step_seconds_kept", useful},
                    {"effective_ratio", ratio}});
      std::printf("keel run: done: %lld steps in %.1f s, %d attempt%s, faults survived: %d%s, effective training "
                  "time %.1f%% (%.1f s in the steps kept)\n",
                  static_cast<long long>(cfg.steps), wall, attempt, attempt == 1 ? "" : "s", total,
                  total ? fmt::format(" ({})", by_kind.dump()).c_str() : "", 100 * ratio, useful);
      return 0;
    }
    // a straggler's device out (the job saved at its stop): on to the next attempt without it
    if (straggler_out && g_stop.load() == 0) {
      excluded.push_back(*straggler_out);
      save_excluded(bad_list, excluded);
      events.write({{"event", "exclude"}, {"attempt", attempt}, {"rank", straggler_rank}, {"host", straggler_out->host},
                    {"gpu", straggler_out->gpu}, {"reason", straggler_out->reason}, {"node_ranks", straggler_out->ranks},
                    {"step", reached},
                    {"saved", done}});  // every rank's "done" heartbeat: written after its stop's save
      useful += median_of(step_times) * static_cast<double>(std::max<std::int64_t>(0, std::min(reached, latest_step(ckpt_root)) - resume));
      apply_excluded();
      std::printf("keel run: rank %d's %s is out (the bad list is %s): the job resumes on %d rank%s from step "
                  "%lld\n",
                  straggler_rank, multi_node ? "node" : "device", bad_list.c_str(), ranks, ranks == 1 ? "" : "s",
                  static_cast<long long>(latest_step(ckpt_root)));
      std::fflush(stdout);
      continue;
    }
    // keel train stopped by a signal saves, writes its "done" heartbeat and exits 128 + signal
    if (!fault && stopping && (clean || done)) {
      events.write({{"event", "stopped"}, {"signal", g_stop.load()}, {"step", reached}});
      std::printf("keel run: stopped by signal %d at step %lld (saved; resume with keel run again)\n", g_stop.load(),
                  static_cast<long long>(reached));
      return 0;
    }
    if (stopping) {
      events.write({{"event", "stopped"}, {"signal", g_stop.load()}, {"step", reached}, {"clean", false}});
      throw Error(fmt::format("run: stopped by signal {}, but the job {} before its ranks had saved (see {})",
                              g_stop.load(),
                              WIFSIGNALED(status) ? fmt::format("ended by signal {}", WTERMSIG(status))
                                                  : fmt::format("exited with {}", WEXITSTATUS(status)),
                              log_path));
    }
    // keel train's own verdict on a non-finite loss or a loss spike, from its last lines (its
    // ranks exit after it, which the pid check may have seen first)
    {
      std::smatch m;
      const std::regex nonfinite("step ([0-9]+): (loss|gradient norm) is");
      const std::regex spike("step ([0-9]+): loss (\\S+) is a spike \\(> mean (\\S+) \\+ \\S+ x std (\\S+) ");
      for (auto it = tail.rbegin(); it != tail.rend(); ++it) {
        const bool is_spike = std::regex_search(*it, m, spike);
        if (!is_spike && !std::regex_search(*it, m, nonfinite)) continue;
        Fault f = fault.value_or(Fault{});
        f.kind = is_spike ? "loss_spike" : "nan", f.skip_step = std::stoll(m[1]), f.detail = *it;
        if (is_spike) f.numbers = {{"loss", std::stod(m[2])}, {"mean", std::stod(m[3])}, {"std", std::stod(m[4])}};
        if (!fault) f.step = reached, f.detect_seconds = o.poll;
        fault = f;
        break;
      }
    }
    // a checkpoint write that found the disk full: keel train's error line names ENOSPC's text
    if (!fault || fault->kind == "dead")
      for (auto it = tail.rbegin(); it != tail.rend(); ++it)
        if (it->find("keel: error:") != std::string::npos && it->find("No space left on device") != std::string::npos) {
          Fault f = fault.value_or(Fault{});
          f.kind = "disk_full", f.detail = *it;
          if (!fault) f.step = reached, f.detect_seconds = o.poll;
          fault = f;
          break;
        }
    if (!fault) {
      Fault f;
      f.step = reached;
      f.detect_seconds = o.poll;
      {
        f.kind = clean ? "exit" : "dead";
        f.detail = WIFSIGNALED(status) ? fmt::format("the job ended by signal {}", WTERMSIG(status))
                                       : fmt::format("the job exited with {}{}", WEXITSTATUS(status),
                                                     clean ? " before its last step" : "");
        for (auto it = tail.rbegin(); it != tail.rend(); ++it)
          if (it->find("keel: error:") != std::string::npos) {
            f.detail += ": " + *it;
            break;
          }
      }
      fault = f;
    }
    // The same error before any step, twice in a row (a bad flag or config, a missing file): no
    // restart will mend it.
    std::string startup_error;
    if (beats.empty() || reached == resume)
      for (auto it = tail.rbegin(); it != tail.rend(); ++it)
        if (it->find("keel: error:") != std::string::npos) {
          startup_error = *it;
          break;
        }
    if (!startup_error.empty() && startup_error == last_startup_error) {
      events.write({{"event", "give_up"}, {"restarts", restarts}, {"last_fault", fault->kind}, {"detail", startup_error}});
      throw Error(fmt::format("run: the job fails at start-up with the same error twice; not restarting it: {}",
                              startup_error.substr(startup_error.find("keel: error:") + 13)));
    }
    last_startup_error = startup_error;
    ++restarts;
    survived[fault->kind]++;
    const std::int64_t next = latest_step(ckpt_root);
    in_a_row = next > resume ? 1 : in_a_row + 1;  // progress (a newer checkpoint) starts the count again
    if ((fault->kind == "nan" || fault->kind == "loss_spike") && fault->skip_step > 0) skips.push_back(fault->skip_step);
    const std::int64_t lost = std::max<std::int64_t>(0, reached - next);
    useful += median_of(step_times) * static_cast<double>(std::max<std::int64_t>(0, std::min(reached, next) - resume));
    nlohmann::json fault_event = {{"event", "fault"}, {"attempt", attempt}, {"kind", fault->kind}, {"rank", fault->rank},
                                  {"host", fault->host}, {"pid", fault->pid}, {"step", fault->step}, {"reached", reached},
                                  {"detect_seconds", fault->detect_seconds}, {"attempt_seconds", attempt_seconds},
                                  {"ranks_exit_seconds", ranks_exit_seconds},
                                  {"detail", fault->detail}, {"skip_step", fault->skip_step}};
    fault_event.update(fault->numbers);
    if (!fault->threads.empty()) fault_event["threads"] = fault->threads;
    fault_event["gpu"] = fault->gpu;  // empty on CPU ranks, or when no heartbeat named it
    events.write(fault_event);
    fault_at = unix_now();
    std::printf("keel run: fault (%s%s) at step %lld: %s; detected in %.2f s\n", fault->kind.c_str(),
                fault->rank >= 0 ? fmt::format(", rank {} on {} pid {}{}", fault->rank, fault->host, fault->pid,
                                               fault->gpu.empty() ? "" : ", GPU " + fault->gpu)
                                       .c_str()
                                 : "",
                static_cast<long long>(reached), fault->detail.c_str(), fault->detect_seconds);
    for (const auto& t : fault->threads) std::printf("keel run:   at detection, %s\n", t.c_str());
    if (in_a_row > o.max_restarts) {
      events.write({{"event", "give_up"}, {"restarts", restarts - 1}, {"last_fault", fault->kind}});
      throw Error(fmt::format("run: gave up after {} restarts without progress (--max-restarts {}; {} in all); the "
                              "last fault: {} at step {} ({}); the events are in {}",
                              in_a_row - 1, o.max_restarts, restarts - 1, fault->kind, reached, fault->detail,
                              o.events.empty() ? (out_dir / "run_events.jsonl").string() : o.events));
    }
    const double wait = std::min(o.backoff_max, o.backoff * std::pow(2.0, in_a_row - 1));
    events.write({{"event", "restart"}, {"attempt", attempt + 1}, {"resume_step", next}, {"steps_lost", lost},
                  {"backoff_seconds", wait}, {"skips", skips}});
    std::printf("keel run: restarting from step %lld (%lld step%s lost) in %.1f s\n", static_cast<long long>(next),
                static_cast<long long>(lost), lost == 1 ? "" : "s", wait);
    std::fflush(stdout);
    // injected faults at steps this attempt did not start are still to come (a fault fires at
    // the start of its step: the step after the last one finished has started)
    std::vector<keel::Fault> still;
    for (const auto& f : pending)
      if (f.first_step > reached + 1) still.push_back(f);
    pending = still;
    std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    if (g_stop.load() != 0) {
      events.write({{"event", "stopped"}, {"signal", g_stop.load()}, {"step", next}});
      std::printf("keel run: signal %d before the restart: stopped at step %lld\n", g_stop.load(),
                  static_cast<long long>(next));
      return 0;
    }
  }
}

}  // namespace keel::run

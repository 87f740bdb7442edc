#include "run/preflight.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "run/child.h"
#include "run/straggler.h"

namespace keel::run {

namespace {

namespace fs = std::filesystem;

// The last lines of a file, for an error message.
std::string tail_of(const std::string& path, int lines) {
  std::ifstream f(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(f, l);) all.push_back(l);
  std::string out;
  for (std::size_t i = all.size() > static_cast<std::size_t>(lines) ? all.size() - lines : 0; i < all.size(); ++i)
    out += (out.empty() ? "" : " | ") + all[i];
  return out;
}

// Runs argv with stdout and stderr into `log`, waiting up to `limit` seconds (then kills its
// process group). Throws keel::Error naming `what` when it does not exit 0.
void run_logged(const std::vector<std::string>& argv, const std::string& log, double limit, const std::string& what) {
  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail("run: pre-flight: cannot write {}: {}", log, std::strerror(errno));
  const pid_t pid = fork_exec(argv, fd);
  close(fd);
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > limit) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      fail("run: pre-flight: {} did not finish in {:.0f} s (log: {})", what, limit, log);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail("run: pre-flight: {} failed ({}): {}", what,
         WIFEXITED(status) ? fmt::format("exit {}", WEXITSTATUS(status)) : "killed", tail_of(log, 3));
}

// Single quotes for sh.
std::string quoted(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail("run: pre-flight: no result {}", path);
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    fail("run: pre-flight: {} is not JSON: {}", path, e.what());
  }
}

}  // namespace

void parse_preflight_floors(const std::string& text, PreflightOptions& o) {
  std::stringstream ss(text);
  for (std::string word; std::getline(ss, word, ',');) {
    const std::size_t eq = word.find('=');
    const std::string key = eq == std::string::npos ? word : word.substr(0, eq);
    double* at = key == "gemm" ? &o.gemm_floor : key == "mem" ? &o.mem_floor : key == "comm" ? &o.comm_floor : nullptr;
    if (!at || eq == std::string::npos)
      throw UsageError(fmt::format("--preflight-floor {}: expected gemm=TFLOPS, mem=GBPS or comm=GBPS", word));
    char* end = nullptr;
    const std::string v = word.substr(eq + 1);
    *at = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !(*at >= 0) || !std::isfinite(*at))
      throw UsageError(fmt::format("--preflight-floor {}: '{}' is not a number >= 0", word, v));
  }
}

void judge(Preflight& p, const PreflightOptions& o) {
  std::vector<double> g, m;
  for (const auto& r : p.ranks) g.push_back(r.gemm_tflops), m.push_back(r.mem_gbps);
  p.gemm_median = median_of(g);
  p.mem_median = median_of(m);
  p.failures.clear();
  p.failed_ranks.clear();
  p.comm_failed = false;
  // Each rank against the median of the OTHER ranks: a slow rank does not drag the bar down with
  // it (with two ranks the median of both would sit halfway to the slow one).
  auto others = [&](std::size_t self, double RankHealth::*field) {
    std::vector<double> v;
    for (std::size_t i = 0; i < p.ranks.size(); ++i)
      if (i != self) v.push_back(p.ranks[i].*field);
    return median_of(v);
  };
  for (std::size_t i = 0; i < p.ranks.size(); ++i) {
    const RankHealth& r = p.ranks[i];
    const std::size_t before = p.failures.size();
    const std::string who = fmt::format("rank {} (host {}, device {}{})", r.rank, r.host, r.device,
                                        r.injected ? ", injected" : "");
    auto check = [&](const char* what, double v, double median, double floor, const char* unit) {
      if (p.ranks.size() > 1 && v < o.fraction * median)
        p.failures.push_back(fmt::format("{}: {} {:.3g} {}, below {} x the other ranks' median {:.3g}", who, what, v,
                                         unit, o.fraction, median));
      else if (floor > 0 && v < floor)
        p.failures.push_back(fmt::format("{}: {} {:.3g} {}, below the floor {:.3g}", who, what, v, unit, floor));
    };
    check("GEMM", r.gemm_tflops, others(i, &RankHealth::gemm_tflops), o.gemm_floor, "TFLOP/s");
    check("memory bandwidth", r.mem_gbps, others(i, &RankHealth::mem_gbps), o.mem_floor, "GB/s");
    if (p.failures.size() > before) p.failed_ranks.push_back(r.rank);
  }
  p.comm_failed = p.ranks.size() > 1 && o.comm_floor > 0 && p.comm_busbw < o.comm_floor;
  if (p.comm_failed)
    p.failures.push_back(fmt::format("the ranks' all-reduce: bus bandwidth {:.3g} GB/s, below the floor {:.3g}",
                                     p.comm_busbw, o.comm_floor));
}

Preflight run_preflight(const std::string& exe, const std::vector<std::string>& launch, int ranks,
                        const std::string& dir, bool cuda, const std::vector<int>& injected,
                        const PreflightOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) fail("run: pre-flight: cannot create {}: {}", dir, ec.message());
  // Each rank: its host, then the two benchmarks on its own device (the launcher's rank
  // variables name the result files and the GPU).
  const std::string rank_var = "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}";
  const std::string local_var = "${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-0}}";
  const std::string gemm = cuda ? "--backend cuda --dtype bf16 --shapes 8192x8192x8192 --no-tune"
                                : "--backend cpu --shapes 1024x1024x1024";
  const std::string mem = cuda ? "--min 1G --max 1G" : "--min 64M --max 64M";
  const std::string d = quoted(dir), k = quoted(exe);
  const std::string script = fmt::format(
      "r={0}; echo \"${{SLURMD_NODENAME:-$(hostname)}}\" > {1}/host.$r && "
      "{2} bench gemm {3} --device {4} -w 2 --iters 5 --no-check -q --json {1}/gemm.$r.json && "
      "{2} bench mem --op triad {5} --device {4} -n 5 -q --json {1}/mem.$r.json",
      rank_var, d, k, gemm, cuda ? local_var : "0", mem);
  std::vector<std::string> argv = launch;
  argv.insert(argv.end(), {"sh", "-c", script});
  run_logged(argv, (fs::path(dir) / "ranks.log").string(), 300, "the GEMM and memory benchmarks");
  Preflight p;
  for (int r = 0; r < ranks; ++r) {
    RankHealth h;
    h.rank = r;
    std::ifstream hf(fs::path(dir) / fmt::format("host.{}", r));
    std::getline(hf, h.host);
    const nlohmann::json g = read_json((fs::path(dir) / fmt::format("gemm.{}.json", r)).string());
    const nlohmann::json m = read_json((fs::path(dir) / fmt::format("mem.{}.json", r)).string());
    try {
      h.gemm_tflops = g.at("results").at(0).at("tflops").get<double>();
      h.mem_gbps = m.at("results").at(0).at("gbps").get<double>();
      if (g.contains("devices") && !g["devices"].empty()) h.device = g["devices"][0].value("name", "");
    } catch (const std::exception& e) {
      fail("run: pre-flight: rank {}'s results lack a figure: {}", r, e.what());
    }
    h.injected = std::find(injected.begin(), injected.end(), r) != injected.end();
    if (h.injected) h.gemm_tflops *= 0.01, h.mem_gbps *= 0.01;
    p.ranks.push_back(h);
  }
  if (ranks > 1) {
    std::vector<std::string> c = launch;
    c.insert(c.end(), {exe, "bench", "comm", "--op", "all_reduce", "-b", "16M", "-e", "16M", "-w", "2", "-n", "5",
                       "--json", (fs::path(dir) / "comm.json").string()});
    run_logged(c, (fs::path(dir) / "comm.log").string(), 300, "the all-reduce benchmark");
    const nlohmann::json j = read_json((fs::path(dir) / "comm.json").string());
    try {
      p.comm_busbw = j.at("results").at(0).at("out_of_place").at("busbw_gbps").get<double>();
    } catch (const std::exception& e) {
      fail("run: pre-flight: the all-reduce result lacks its bus bandwidth: {}", e.what());
    }
  }
  judge(p, o);
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

nlohmann::json preflight_event(const Preflight& p, int attempt) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : p.ranks)
    ranks.push_back({{"rank", r.rank}, {"host", r.host}, {"device", r.device}, {"gemm_tflops", r.gemm_tflops},
                     {"mem_gbps", r.mem_gbps}, {"injected", r.injected}});
  return {{"event", "preflight"}, {"attempt", attempt}, {"ok", p.failures.empty()}, {"ranks", ranks},
          {"comm_busbw_gbps", p.comm_busbw}, {"gemm_median", p.gemm_median}, {"mem_median", p.mem_median},
          {"failures", p.failures}, {"seconds", p.seconds}};
}

std::vector<Excluded> load_excluded(const std::string& path) {
  std::vector<Excluded> out;
  if (!fs::exists(path)) return out;
  try {
    std::ifstream f(path);
    const nlohmann::json j = nlohmann::json::parse(f);
    for (const auto& e : j.at("excluded"))
      out.push_back({e.at("host").get<std::string>(), e.at("gpu").get<std::string>(), e.value("device", ""),
                     e.value("reason", ""), e.value("attempt", 0), e.value("ranks", 0)});
  } catch (const std::exception& e) {
    fail("run: the bad list {} is not one (JSON with an 'excluded' list of host, gpu): {}; move it aside to start "
         "with every device",
         path, e.what());
  }
  return out;
}

void save_excluded(const std::string& path, const std::vector<Excluded>& list) {
  nlohmann::json j = {{"excluded", nlohmann::json::array()}};
  for (const auto& e : list)
    j["excluded"].push_back(
        {{"host", e.host}, {"gpu", e.gpu}, {"device", e.device}, {"reason", e.reason}, {"attempt", e.attempt},
         {"ranks", e.ranks}});
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << j.dump(1) << "\n";
    if (!f) fail("run: cannot write the bad list {}", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail("run: cannot write the bad list {}: {}", path, ec.message());
}

}  // namespace keel::run

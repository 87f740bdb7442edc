#include "bench/comm/runner.h"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/units.h"
#include "common/watchdog.h"

namespace keel::bench {
namespace {

// Concatenates every process's doubles on rank 0 (others get an empty vector).
std::vector<double> gather_to_root(const std::vector<double>& local) {
  int procs = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &procs);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  const int n = static_cast<int>(local.size());
  std::vector<int> counts(static_cast<size_t>(procs)), displs(static_cast<size_t>(procs));
  PeerWait wait("MPI_Gather (results to rank 0)");
  mpi_check(MPI_Gather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Gather");
  std::vector<double> all;
  if (me == 0) {
    std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), 0);
    all.resize(static_cast<size_t>(displs.back() + counts.back()));
  }
  mpi_check(MPI_Gatherv(local.data(), n, MPI_DOUBLE, all.data(), counts.data(), displs.data(), MPI_DOUBLE, 0,
                        MPI_COMM_WORLD),
            "MPI_Gatherv");
  return all;
}

std::vector<std::string> gather_strings(const std::string& local) {
  std::vector<double> as_doubles;
  for (unsigned char ch : local) as_doubles.push_back(ch);
  as_doubles.push_back(-1);  // separator
  std::vector<double> all = gather_to_root(as_doubles);
  std::vector<std::string> out;
  std::string cur;
  for (double d : all) {
    if (d < 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(static_cast<char>(d));
    }
  }
  return out;
}

std::vector<DeviceDescription> gather_devices(const Backend& b) {
  nlohmann::json local = nlohmann::json::array();
  for (const auto& d : b.local_devices())
    local.push_back({{"rank", d.rank}, {"host", d.host}, {"name", d.name}, {"bus_id", d.bus_id}, {"device", d.device}});
  std::vector<DeviceDescription> out;
  for (const auto& text : gather_strings(local.dump())) {
    for (const auto& j : nlohmann::json::parse(text)) {
      DeviceDescription d;
      d.rank = j["rank"];
      d.host = j["host"];
      d.name = j["name"];
      d.bus_id = j["bus_id"];
      d.device = j["device"];
      out.push_back(d);
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  return out;
}

std::vector<RankTiming> gather_timings(const std::vector<RankTiming>& local) {
  std::vector<double> flat;
  for (const auto& t : local) {
    flat.push_back(t.rank);
    flat.push_back(t.seconds_per_op);
    flat.push_back(static_cast<double>(t.iter_seconds.size()));
    flat.insert(flat.end(), t.iter_seconds.begin(), t.iter_seconds.end());
  }
  std::vector<double> all = gather_to_root(flat);
  std::vector<RankTiming> out;
  for (size_t i = 0; i < all.size();) {
    RankTiming t;
    t.rank = static_cast<int>(all[i]);
    t.seconds_per_op = all[i + 1];
    const auto k = static_cast<size_t>(all[i + 2]);
    t.iter_seconds.assign(all.begin() + static_cast<std::ptrdiff_t>(i + 3),
                          all.begin() + static_cast<std::ptrdiff_t>(i + 3 + k));
    i += 3 + k;
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<RankCheck> gather_checks(const std::vector<RankCheck>& local) {
  std::vector<double> flat;
  for (const auto& c : local) {
    flat.insert(flat.end(), {static_cast<double>(c.rank), static_cast<double>(c.wrong),
                             static_cast<double>(c.first_wrong), c.got, c.expected});
  }
  std::vector<double> all = gather_to_root(flat);
  std::vector<RankCheck> out;
  for (size_t i = 0; i + 5 <= all.size(); i += 5) {
    RankCheck c;
    c.rank = static_cast<int>(all[i]);
    c.wrong = static_cast<std::uint64_t>(all[i + 1]);
    c.first_wrong = static_cast<std::int64_t>(all[i + 2]);
    c.got = static_cast<float>(all[i + 3]);
    c.expected = static_cast<float>(all[i + 4]);
    out.push_back(c);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  return out;
}

void summarize(const CollectiveCase& c, int group, const std::vector<RankTiming>& timings,
               const std::vector<RankCheck>& checks, PlacementResult* r) {
  const int n = c.nranks;
  std::vector<const RankTiming*> members;
  for (const auto& t : timings)
    if (t.rank / n == group) members.push_back(&t);
  if (members.empty()) return;
  r->measured = true;
  double sum = 0;
  size_t iters = SIZE_MAX;
  for (const auto* t : members) {
    sum += t->seconds_per_op;
    iters = std::min(iters, t->iter_seconds.size());
  }
  const double seconds = sum / static_cast<double>(members.size());
  r->time_us = seconds * 1e6;
  r->algbw = static_cast<double>(c.shape.size_bytes) / seconds / 1e9;
  r->busbw = r->algbw * busbw_factor(c.op, n);
  // An iteration is as slow as its slowest rank.
  std::vector<double> slowest(iters, 0.0);
  double worst_mean = -1;
  for (const auto* t : members) {
    double mean = 0;
    for (size_t i = 0; i < iters; ++i) {
      slowest[i] = std::max(slowest[i], t->iter_seconds[i]);
      mean += t->iter_seconds[i];
    }
    mean /= static_cast<double>(std::max<size_t>(iters, 1));
    if (mean > worst_mean) {
      worst_mean = mean;
      r->slowest_rank = t->rank;
    }
  }
  r->slowest_rank_us = worst_mean * 1e6;
  r->iter_p50_us = percentile(slowest, 50) * 1e6;
  r->iter_p99_us = percentile(slowest, 99) * 1e6;
  for (const auto& k : checks) {
    if (k.rank / n != group || k.wrong == 0) continue;
    if (r->wrong == 0)
      r->first_wrong = fmt::format("rank {} element {}: got {:g}, expected {:g}", k.rank, k.first_wrong, k.got, k.expected);
    r->wrong += k.wrong;
  }
}

std::string case_label(const CollectiveCase& c, int group, int ngroups) {
  std::string label = fmt::format("{} {} of {} on {} rank{}", collective_name(c.op), dtype_name(c.dtype),
                                  format_size(c.shape.size_bytes), c.nranks, c.nranks == 1 ? "" : "s");
  if (ngroups > 1) label += fmt::format(" (group {} of {})", group, ngroups);
  return label;
}

}  // namespace

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t idx = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(v.size()))) - 1;
  return v[idx];
}

std::vector<std::uint64_t> case_sizes(const CommOptions& o, Collective op, DType t, int nranks) {
  const std::uint64_t granularity = size_granularity(op, t, nranks);
  std::vector<std::uint64_t> out;
  for (std::uint64_t s : geometric_sizes(o.min_bytes, o.max_bytes, o.factor)) {
    // A size the user typed must split as it is (collective_shape says why not); the ones a
    // non-integer factor produced in between are rounded down, as nccl-tests does.
    if (s == o.min_bytes || s == o.max_bytes) (void)collective_shape(op, s, t, nranks);
    else s -= s % granularity;
    if (out.empty() || s != out.back()) out.push_back(s);
  }
  return out;
}

SweepBuffers largest_buffers(const CommOptions& o, int world) {
  SweepBuffers b;
  const std::vector<int> ranks = o.ranks.empty() ? std::vector<int>{world} : o.ranks;
  for (int n : ranks)
    for (Collective op : o.ops)
      for (DType t : o.dtypes)
        for (std::uint64_t s : case_sizes(o, op, t, n)) {
          const CollectiveShape shape = collective_shape(op, s, t, n);
          const std::uint64_t send = shape.send_count * dtype_size(t), recv = shape.recv_count * dtype_size(t);
          b.send = std::max(b.send, send);
          b.recv = std::max(b.recv, recv);
          if (collective_reduces(op)) b.reduce = std::max({b.reduce, send, recv});
        }
  return b;
}

std::string host_memory_problem(const SweepBuffers& need, int ranks_on_host, std::uint64_t available,
                                const std::string& host) {
  const std::uint64_t per_rank = need.send + need.recv + need.reduce;  // each at most 1 PiB
  const std::uint64_t ranks = static_cast<std::uint64_t>(std::max(ranks_on_host, 1));
  const std::uint64_t total = per_rank > UINT64_MAX / ranks ? UINT64_MAX : per_rank * ranks;
  // The same margin as bench mem's and bench gemm's CPU checks: the OS, MPI and the page cache
  // keep some of what MemAvailable counts.
  if (total <= available / 10 * 9) return "";
  return fmt::format(
      "bench comm: the sweep needs {} of host memory on {}: {} rank{} x ({} send + {} receive buffers{}), but only {} "
      "is available: lower --max (-e){}",
      format_size(total), host, ranks, ranks == 1 ? "" : "s", format_size(need.send), format_size(need.recv),
      need.reduce ? fmt::format(" + up to {} of MPI reduction scratch", format_size(need.reduce)) : "",
      format_size(available), ranks > 1 ? " or start fewer ranks on this host" : "");
}

void validate_options(const CommOptions& o, int world) {
  try {
    if (o.plan.iters < 1) fail("--iters must be at least 1, got {}", o.plan.iters);
    if (o.plan.warmup < 0) fail("--warmup must not be negative, got {}", o.plan.warmup);
    if (o.plan.graph_replays < 0) fail("--graph must not be negative, got {}", o.plan.graph_replays);
    // inf is allowed (no deadline); NaN is not a limit at all.
    check_timeout_flag(o.plan.timeout_s);  // 0 or inf: no deadline
    if (o.plan.graph_replays > 0 && o.backend == "mpi") fail("--graph needs the nccl backend (CUDA graphs)");
    // NaN would compare false against every busbw and so silently pass the gate.
    if (!(o.min_busbw >= 0) || !std::isfinite(o.min_busbw))
      fail("--min-busbw must be a finite number of GB/s, 0 or more, got {}", o.min_busbw);
    (void)geometric_sizes(o.min_bytes, o.max_bytes, o.factor);
    const std::vector<int> ranks = o.ranks.empty() ? std::vector<int>{world} : o.ranks;
    for (int n : ranks) {
      if (n > world)
        fail("--ranks {} needs {} ranks but only {} are available{}", n, n, world,
             o.backend == "mpi" ? " (launch more with mpirun -n)" : "");
      // On one rank a reduction moves nothing (busbw 0) and a broadcast or ring is a local copy.
      if (n < 2)
        fail("collectives need at least 2 ranks, {}", o.ranks.empty()
                                                          ? fmt::format("but the world has {} (launch more with mpirun "
                                                                        "-n, or make more GPUs visible)", world)
                                                          : fmt::format("got --ranks {}", n));
      if (o.all_groups && world % n != 0)
        fail("--all-groups: {} ranks do not split into groups of {}", world, n);
      bool any_placement = false;
      for (Collective op : o.ops) {
        if (o.placement == Placement::kInPlace && !collective_has_in_place(op))
          fail("{} has no in-place form; use --placement out or both", collective_name(op));
        any_placement = true;
        if (op == Collective::kBroadcast && o.root >= n)
          fail("--root {} is not a rank of a {}-rank group", o.root, n);
        for (DType t : o.dtypes) (void)case_sizes(o, op, t, n);
      }
      if (!any_placement) fail("nothing to measure");
    }
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

CommReport run_comm_bench(Backend& b, const CommOptions& o, RowSink* sink) {
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  CommReport report;
  report.backend = b.name();
  report.world_size = b.world_size();
  report.versions = b.library_versions();
  b.set_hang_rank(o.hang_at_start ? -1 : o.hang_rank);
  b.set_corrupt_rank(o.corrupt_rank);
  b.set_error_rank(o.error_rank);

  Watchdog dog;
  // Every place a process blocks on others inside the watchdog's scopes is a PeerWait (the
  // backends' collectives, barriers and stream waits, the gathers above), so a timeout names
  // the stuck process rather than every process saying the same.
  int procs = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &procs);
  if (procs > 1) dog.track_peer_waits();
  {
    WatchdogScope scope(dog, "gathering the device descriptions", o.plan.timeout_s);
    report.devices = gather_devices(b);
  }
  const std::vector<int> ranks = o.ranks.empty() ? std::vector<int>{b.world_size()} : o.ranks;
  std::uint64_t seed = o.seed;

  for (int n : ranks) {
    const int ngroups = o.all_groups ? b.world_size() / n : 1;
    {
      WatchdogScope scope(dog, fmt::format("forming communicators of {} ranks", n), o.plan.timeout_s);
      b.form_groups(n, o.all_groups);
    }
    for (Collective op : o.ops) {
      for (DType dtype : o.dtypes) {
        const std::vector<RedOp> redops = collective_reduces(op) ? o.redops : std::vector<RedOp>{RedOp::kSum};
        const auto sizes = case_sizes(o, op, dtype, n);
        for (RedOp redop : redops) {
          std::uint64_t send_max = 0, recv_max = 0;
          for (auto s : sizes) {
            const auto shape = collective_shape(op, s, dtype, n);
            send_max = std::max(send_max, shape.send_count * dtype_size(dtype));
            recv_max = std::max(recv_max, shape.recv_count * dtype_size(dtype));
          }
          b.reserve(send_max, recv_max);
          bool first_row = true;
          for (auto size : sizes) {
            std::vector<ResultRow> rows(static_cast<size_t>(ngroups));
            for (int g = 0; g < ngroups; ++g) {
              ResultRow& r = rows[static_cast<size_t>(g)];
              r.op = op;
              r.dtype = dtype;
              r.redop = redop;
              r.reduces = collective_reduces(op);
              r.nranks = n;
              r.group = g;
              r.ngroups = ngroups;
              r.size_bytes = size;
              r.count = size / dtype_size(dtype);
            }
            for (int placement = 0; placement < 2; ++placement) {
              const bool in_place = placement == 1;
              if (in_place && (o.placement == Placement::kOutOfPlace || !collective_has_in_place(op))) continue;
              if (!in_place && o.placement == Placement::kInPlace) continue;
              CollectiveCase c;
              c.op = op;
              c.dtype = dtype;
              c.redop = redop;
              c.in_place = in_place;
              c.root = o.root;
              c.shape = collective_shape(op, size, dtype, n);
              c.nranks = n;
              WatchdogScope scope(dog, case_label(c, 0, 1), o.plan.timeout_s);
              std::vector<RankTiming> local_t;
              b.measure(c, o.plan, &local_t);
              std::vector<RankCheck> local_c;
              if (o.check) b.check(c, ++seed, o.plan.timeout_s, &local_c);
              const auto timings = gather_timings(local_t);
              const auto checks = gather_checks(local_c);
              if (me == 0) {
                for (int g = 0; g < ngroups; ++g) {
                  ResultRow& r = rows[static_cast<size_t>(g)];
                  summarize(c, g, timings, checks, in_place ? &r.in_place : &r.out_of_place);
                }
              }
            }
            if (me == 0) {
              for (auto& r : rows) {
                if (sink && first_row) sink->begin_block(r);
                first_row = false;
                if (sink) sink->row(r);
                report.rows.push_back(r);
              }
            }
          }
        }
      }
    }
  }
  return report;
}

}  // namespace keel::bench

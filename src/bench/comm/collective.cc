#include "bench/comm/collective.h"

#include <algorithm>
#include <string>

#include "common/error.h"
#include "common/units.h"

namespace keel::bench {
namespace {

constexpr Collective kAll[] = {Collective::kAllReduce, Collective::kAllGather, Collective::kReduceScatter,
                               Collective::kBroadcast, Collective::kAllToAll,  Collective::kSendRecv};

std::string normalize(std::string_view s) {
  std::string out;
  for (char ch : s) {
    if (ch == '-' || ch == '_') continue;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
  }
  return out;
}

}  // namespace

std::string_view collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kSendRecv: return "send_recv";
  }
  return "?";
}

std::vector<Collective> parse_collectives(std::string_view list) {
  std::vector<Collective> out;
  auto add = [&](Collective c) {
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  };
  for (const auto& part : split_list(list)) {
    const std::string n = normalize(part);
    if (n == "all") {
      for (Collective c : kAll) add(c);
      continue;
    }
    bool found = false;
    for (Collective c : kAll) {
      if (normalize(collective_name(c)) == n) {
        add(c);
        found = true;
      }
    }
    if (!found)
      fail("unknown op '{}' (choose all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send_recv or all)",
           part);
  }
  if (out.empty()) fail("--op is empty");
  return out;
}

std::string_view redop_name(RedOp op) { return op == RedOp::kSum ? "sum" : "avg"; }

RedOp parse_redop(std::string_view name) {
  if (name == "sum") return RedOp::kSum;
  if (name == "avg" || name == "mean") return RedOp::kAvg;
  fail("unknown reduce op '{}' (choose sum or avg)", name);
}

bool collective_reduces(Collective c) { return c == Collective::kAllReduce || c == Collective::kReduceScatter; }

bool collective_has_in_place(Collective c) { return c != Collective::kAllToAll && c != Collective::kSendRecv; }

double busbw_factor(Collective c, int nranks) {
  const double n = nranks;
  switch (c) {
    case Collective::kAllReduce: return 2.0 * (n - 1) / n;
    case Collective::kAllGather:
    case Collective::kReduceScatter:
    case Collective::kAllToAll: return (n - 1) / n;
    case Collective::kBroadcast:
    case Collective::kSendRecv: return 1.0;
  }
  return 1.0;
}

std::uint64_t size_granularity(Collective c, DType t, int nranks) {
  const std::uint64_t ts = dtype_size(t);
  switch (c) {
    case Collective::kAllGather:
    case Collective::kReduceScatter:
    case Collective::kAllToAll: return ts * static_cast<std::uint64_t>(nranks);
    default: return ts;
  }
}

CollectiveShape collective_shape(Collective c, std::uint64_t size_bytes, DType t, int nranks) {
  if (nranks < 1) fail("rank count must be positive, got {}", nranks);
  const std::uint64_t g = size_granularity(c, t, nranks);
  if (size_bytes == 0 || size_bytes % g != 0) {
    if (g == dtype_size(t))
      fail("size {} is not a multiple of the {} element size ({} B)", format_size(size_bytes), dtype_name(t), g);
    fail("size {} does not split over {} ranks of {} as {} needs: use a multiple of {} B", format_size(size_bytes),
         nranks, dtype_name(t), collective_name(c), g);
  }
  const std::uint64_t total = size_bytes / dtype_size(t);
  CollectiveShape s;
  s.size_bytes = size_bytes;
  switch (c) {
    case Collective::kAllReduce:
    case Collective::kBroadcast:
    case Collective::kSendRecv:
    case Collective::kAllToAll:
      s.send_count = s.recv_count = total;
      break;
    case Collective::kAllGather:
      s.send_count = total / nranks;
      s.recv_count = total;
      break;
    case Collective::kReduceScatter:
      s.send_count = total;
      s.recv_count = total / nranks;
      break;
  }
  return s;
}

}  // namespace keel::bench

// What `keel bench comm` measures: the collectives, their buffer shapes, and the bus-bandwidth
// factors. Sizes and bandwidths follow nccl-tests exactly so keel's rows compare 1:1 with
// published nccl-tests tables: the printed size is the larger of the send and receive
// buffers, algbw = size / time, and busbw = algbw x factor (see busbw_factor).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/dtype.h"

namespace keel::bench {

enum class Collective { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kAllToAll, kSendRecv };
enum class RedOp { kSum, kAvg };

std::string_view collective_name(Collective c);
// Accepts all_reduce / allreduce / all-reduce and the same for the others; "all" expands to
// every collective. Throws keel::Error on an unknown name.
std::vector<Collective> parse_collectives(std::string_view list);
std::string_view redop_name(RedOp op);
RedOp parse_redop(std::string_view name);

bool collective_reduces(Collective c);
// In-place is defined for all-reduce, all-gather, reduce-scatter and broadcast; all-to-all
// and the send/recv ring need distinct buffers (NCCL does not define them in place).
bool collective_has_in_place(Collective c);
// nccl-tests' busbw factors: 2(n-1)/n all-reduce; (n-1)/n all-gather, reduce-scatter and
// all-to-all; 1 broadcast and send/recv.
double busbw_factor(Collective c, int nranks);

// Per-rank buffer shape for a message of `size_bytes` (the larger buffer, as printed).
struct CollectiveShape {
  std::uint64_t size_bytes = 0;
  std::uint64_t send_count = 0;  // elements in each rank's send buffer
  std::uint64_t recv_count = 0;  // elements in each rank's receive buffer
};
// Throws keel::Error when the size cannot be split as the collective needs (e.g. an
// all-gather of 8 B over 8 ranks of fp32).
CollectiveShape collective_shape(Collective c, std::uint64_t size_bytes, DType t, int nranks);
// The granularity a size must be a multiple of for this collective, dtype and rank count.
std::uint64_t size_granularity(Collective c, DType t, int nranks);

}  // namespace keel::bench

#include "bench/mem/ops.h"

#include <algorithm>

#include "common/error.h"
#include "common/units.h"

namespace keel::bench {
namespace {

constexpr MemOp kAllOps[] = {MemOp::kCopy,        MemOp::kMul,          MemOp::kAdd,        MemOp::kTriad,
                             MemOp::kDot,         MemOp::kNstream,      MemOp::kMemcpy,     MemOp::kH2DPinned,
                             MemOp::kH2DPageable, MemOp::kD2HPinned,    MemOp::kD2HPageable, MemOp::kPeerWrite,
                             MemOp::kPeerRead,    MemOp::kPeerBidirWrite, MemOp::kPeerBidirRead};

}  // namespace

std::string_view mem_op_name(MemOp op) {
  switch (op) {
    case MemOp::kCopy: return "copy";
    case MemOp::kMul: return "mul";
    case MemOp::kAdd: return "add";
    case MemOp::kTriad: return "triad";
    case MemOp::kDot: return "dot";
    case MemOp::kNstream: return "nstream";
    case MemOp::kMemcpy: return "memcpy";
    case MemOp::kH2DPinned: return "h2d_pinned";
    case MemOp::kH2DPageable: return "h2d_pageable";
    case MemOp::kD2HPinned: return "d2h_pinned";
    case MemOp::kD2HPageable: return "d2h_pageable";
    case MemOp::kPeerWrite: return "peer_write";
    case MemOp::kPeerRead: return "peer_read";
    case MemOp::kPeerBidirWrite: return "peer_bidir_write";
    case MemOp::kPeerBidirRead: return "peer_bidir_read";
  }
  return "?";
}

std::string_view mem_type_name(MemType t) { return t == MemType::kF32 ? "fp32" : "fp64"; }

MemType parse_mem_type(std::string_view name) {
  if (name == "fp32" || name == "float" || name == "float32") return MemType::kF32;
  if (name == "fp64" || name == "double" || name == "float64") return MemType::kF64;
  fail("unknown dtype '{}' for bench mem (choose fp32 or fp64)", name);
}

bool is_stream_kernel(MemOp op) { return op <= MemOp::kNstream; }
bool is_host_transfer(MemOp op) { return op >= MemOp::kH2DPinned && op <= MemOp::kD2HPageable; }
bool is_peer(MemOp op) { return op >= MemOp::kPeerWrite; }
bool is_bidirectional(MemOp op) { return op == MemOp::kPeerBidirWrite || op == MemOp::kPeerBidirRead; }

std::vector<MemOp> parse_mem_ops(std::string_view text) {
  std::vector<bool> want(std::size(kAllOps), false);
  const auto parts = split_list(text);
  if (parts.empty()) fail("--op is empty");
  for (const auto& p : parts) {
    bool known = false;
    for (std::size_t i = 0; i < std::size(kAllOps); ++i) {
      const MemOp op = kAllOps[i];
      const bool hit = p == "all" || p == mem_op_name(op) ||
                       (p == "stream" && (is_stream_kernel(op) || op == MemOp::kMemcpy)) ||
                       (p == "transfers" && is_host_transfer(op)) || (p == "peer" && is_peer(op));
      if (hit) want[i] = true;
      known |= hit;
    }
    if (!known)
      fail("unknown op '{}' (choose copy, mul, add, triad, dot, nstream, memcpy, h2d_pinned, h2d_pageable, "
           "d2h_pinned, d2h_pageable, peer_write, peer_read, peer_bidir_write, peer_bidir_read, or the groups "
           "stream, transfers, peer, all)",
           p);
  }
  std::vector<MemOp> ops;
  for (std::size_t i = 0; i < std::size(kAllOps); ++i)
    if (want[i]) ops.push_back(kAllOps[i]);
  return ops;
}

std::uint64_t bytes_moved(MemOp op, MemType t, std::uint64_t elements) {
  const std::uint64_t array = elements * mem_type_size(t);
  switch (op) {
    case MemOp::kCopy:
    case MemOp::kMul:
    case MemOp::kDot:
    case MemOp::kMemcpy: return 2 * array;
    case MemOp::kAdd:
    case MemOp::kTriad: return 3 * array;
    case MemOp::kNstream: return 4 * array;
    case MemOp::kPeerBidirWrite:
    case MemOp::kPeerBidirRead: return 2 * array;
    default: return array;
  }
}

int arrays_needed(MemOp op) {
  if (is_stream_kernel(op)) return 3;  // a, b and c, as BabelStream allocates them for every kernel
  if (op == MemOp::kMemcpy) return 2;
  if (is_host_transfer(op)) return 1;  // plus one host buffer
  return 2;                            // peer: a source and a destination on each GPU taking part
}

}  // namespace keel::bench

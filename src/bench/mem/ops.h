// What `keel bench mem` measures: the BabelStream kernels on device (or host) memory, the
// device-local copy through the copy engine, and copy-engine transfers between host and device
// and between GPUs. Each op knows how many bytes one run moves, counted the BabelStream way.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel::bench {

enum class MemOp {
  // BabelStream kernels (SM loads and stores).
  kCopy, kMul, kAdd, kTriad, kDot, kNstream,
  // Copy engine within one device (cudaMemcpyAsync D2D; memcpy on CPUs).
  kMemcpy,
  // Copy engine across PCIe: pinned (page-locked) and pageable host buffers.
  kH2DPinned, kH2DPageable, kD2HPinned, kD2HPageable,
  // Copy engine between GPUs: issued by the source (write) or the destination (read), one
  // direction or both at once.
  kPeerWrite, kPeerRead, kPeerBidirWrite, kPeerBidirRead,
};

enum class MemType { kF32, kF64 };

std::string_view mem_op_name(MemOp op);
std::string_view mem_type_name(MemType t);
inline constexpr std::size_t mem_type_size(MemType t) { return t == MemType::kF32 ? 4 : 8; }
MemType parse_mem_type(std::string_view name);  // fp32/float, fp64/double

bool is_stream_kernel(MemOp op);   // copy .. nstream
bool is_host_transfer(MemOp op);   // h2d/d2h
bool is_peer(MemOp op);            // GPU to GPU
bool is_bidirectional(MemOp op);

// Parses a comma list of op names and the groups "stream" (the six kernels and memcpy),
// "transfers" (host<->device), "peer" and "all". Keeps the canonical order; throws
// keel::Error on an unknown name.
std::vector<MemOp> parse_mem_ops(std::string_view text);

// Bytes one run moves for arrays of `elements` elements of `t`: bytes read plus bytes written
// (BabelStream: copy/mul 2, add/triad 3, dot 2, nstream 4 arrays; memcpy reads and writes its
// array). Transfers count the bytes that cross the link, both directions for bidirectional ones.
std::uint64_t bytes_moved(MemOp op, MemType t, std::uint64_t elements);

// Arrays of `elements` elements the op allocates on a device (or the host for CPU runs).
int arrays_needed(MemOp op);

}  // namespace keel::bench

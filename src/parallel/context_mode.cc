#include "parallel/context_mode.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"

namespace keel::parallel {

ContextMode parse_context_mode(const std::string& word) {
  if (word == "allgather") return ContextMode::kAllGather;
  if (word == "ring") return ContextMode::kRing;
  if (word == "alltoall") return ContextMode::kAllToAll;
  throw UsageError(fmt::format("unknown context mode '{}' (allgather, ring or alltoall)", word));
}

ContextMode auto_context_mode(bool linear_layers, int tensor, int tsp) {
  return !linear_layers && tensor <= 1 && tsp <= 1 ? ContextMode::kRing : ContextMode::kAllGather;
}

const char* context_mode_name(ContextMode m) {
  switch (m) {
    case ContextMode::kAllGather: return "allgather";
    case ContextMode::kRing: return "ring";
    case ContextMode::kAllToAll: return "alltoall";
  }
  return "?";
}

const char* context_buffer_name(ContextMode m) {
  switch (m) {
    case ContextMode::kRing:
      return "context-parallel ring blocks";
    case ContextMode::kAllToAll:
      return "context-parallel all-to-all buffers";
    case ContextMode::kAllGather:
      break;
  }
  return "context-parallel k/v gathers";
}


namespace {
constexpr std::size_t kBf16 = 2, kFp32 = 4;
std::size_t bytes(std::int64_t n, std::size_t elem) { return context_aligned(static_cast<std::size_t>(n) * elem); }
}  // namespace

std::size_t context_aligned(std::size_t b) { return (b + 255) / 256 * 256; }

std::size_t ring_forward_bytes(const ContextExtents& e) {
  return 2 * bytes(2 * e.kv(), kBf16) + 2 * bytes(e.q(), kFp32) + 2 * bytes(e.lse(), kFp32);
}

std::size_t ring_backward_bytes(const ContextExtents& e) {
  return 2 * (bytes(2 * e.kv(), kBf16) + bytes(2 * e.kv(), kFp32)) + bytes(e.q(), kFp32) + bytes(e.lse(), kFp32) +
         bytes(e.kv(), kBf16);
}

std::size_t alltoall_forward_bytes(const ContextExtents& e) {
  return 2 * bytes(e.q(), kBf16) + 2 * bytes(e.q(), kBf16) + 2 * bytes(e.kv(), kBf16) + bytes(e.lse(), kFp32);
}

std::size_t alltoall_backward_bytes(const ContextExtents& e) {
  return 2 * bytes(e.q(), kBf16) + 4 * bytes(e.q(), kBf16) + 4 * bytes(e.kv(), kBf16) + bytes(e.lse(), kFp32);
}

std::size_t alltoall_linear_forward_bytes(const ContextExtents& e) {
  return 2 * bytes(e.q(), kBf16) + 2 * bytes(e.q(), kBf16) + 2 * bytes(e.kv(), kBf16);
}

std::size_t alltoall_linear_backward_bytes(const ContextExtents& e) {
  return 2 * bytes(e.q(), kBf16) + 3 * bytes(e.q(), kBf16) + 4 * bytes(e.kv(), kBf16);
}

std::size_t ring_buffer_bytes(const ContextExtents& e) { return std::max(ring_forward_bytes(e), ring_backward_bytes(e)); }

std::size_t alltoall_buffer_bytes(const ContextExtents& e, bool softmax, bool linear) {
  std::size_t b = 0;
  if (softmax) b = std::max({b, alltoall_forward_bytes(e), alltoall_backward_bytes(e)});
  if (linear) b = std::max({b, alltoall_linear_forward_bytes(e), alltoall_linear_backward_bytes(e)});
  return b;
}

}  // namespace keel::parallel

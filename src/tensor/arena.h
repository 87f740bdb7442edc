// Arena: one aligned allocation carved into named regions by a bump pointer.
//
// Parameters, gradients, optimizer states and activations each live in one Arena instead of
// one allocation per tensor, so a whole class of state can be zeroed, checkpointed or sent as
// one buffer. Ownership: the Arena owns its block (freed in the destructor); every pointer or
// Tensor it hands out is a non-owning view that is valid until reset() or destruction. There
// is no per-region free: reset() releases every region at once (e.g. activations each step).
// Regions start at 64-byte boundaries (a cache line; also enough for AVX-512 and CUDA loads).
// Not thread-safe: allocate from one thread, then use the regions from many.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "tensor/tensor.h"

namespace keel {

class Arena {
 public:
  static constexpr std::size_t kAlignment = 64;

  struct Region {
    std::string name;
    std::size_t offset = 0;  // bytes from base()
    std::size_t bytes = 0;   // requested size (before rounding up to the alignment)
  };

  // Allocates `capacity_bytes` (zero-filled) at once; `name` appears in error messages.
  Arena(std::string name, std::size_t capacity_bytes);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // A 64-byte-aligned region of `bytes` bytes. Throws keel::Error naming the arena, the region
  // and the sizes when it does not fit ("arena 'acts': region 'layer3.attn' needs 4 MiB, only
  // 1 MiB of 16 MiB left").
  void* allocate_bytes(std::string_view what, std::size_t bytes);
  template <typename T>
  T* allocate(std::string_view what, std::size_t count) {
    return static_cast<T*>(allocate_bytes(what, count * sizeof(T)));
  }
  // A float region shaped as a Tensor view (contents: whatever was there; zero on a fresh arena).
  Tensor tensor(std::string_view what, std::initializer_list<std::int64_t> shape);

  // Forgets every region; memory is reused from the start. Views handed out before are invalid.
  void reset();
  // Zero-fills the used part (e.g. gradients before accumulation).
  void zero_used();

  const std::string& name() const { return name_; }
  std::byte* base() const { return base_; }
  std::size_t capacity() const { return capacity_; }
  std::size_t used() const { return used_; }
  std::size_t remaining() const { return capacity_ - used_; }
  const std::vector<Region>& regions() const { return regions_; }
  // The region containing `p`, or nullptr (for debugging and error messages).
  const Region* find(const void* p) const;

  // Bytes a region of `bytes` takes in an arena (rounded up to the alignment), to size arenas.
  static std::size_t footprint(std::size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

 private:
  std::string name_;
  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0, used_ = 0;
  std::vector<Region> regions_;
};

// Lays regions out in an Arena in two passes, the way keel's CPU models plan their activations:
// without an arena it only counts the bytes the same calls would take (so the arena can be made
// at its exact size) and hands out empty views; with one it hands out the regions.
class ArenaPlanner {
 public:
  explicit ArenaPlanner(Arena* arena = nullptr) : arena_(arena) {}
  Tensor tensor(std::string_view what, std::initializer_list<std::int64_t> shape);
  void* bytes(std::string_view what, std::size_t n);
  template <typename T>
  T* take(std::string_view what, std::size_t count) {
    return static_cast<T*>(bytes(what, count * sizeof(T)));
  }
  bool sizing() const { return arena_ == nullptr; }
  std::size_t counted() const { return counted_; }  // bytes the sizing pass counted

 private:
  Arena* arena_;
  std::size_t counted_ = 0;
};

}  // namespace keel

#include "tensor/arena.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "common/error.h"
#include "common/host.h"
#include "common/units.h"

namespace keel {
Arena::Arena(std::string name, std::size_t capacity_bytes) : name_(std::move(name)) {
  capacity_ = footprint(capacity_bytes);
  // Touching more than the machine has gets the process killed without a word (the OOM
  // killer), so a request beyond what is available is an error here instead.
  if (const auto avail = host_mem_available_bytes(); avail && *avail > 0 && capacity_ > *avail)
    fail("arena '{}': needs {} but this machine has {} of memory available: train a smaller model, batch or "
         "sequence, or on GPUs",
         name_, format_size(capacity_), format_size(*avail));
  if (capacity_ > 0) {
    base_ = static_cast<std::byte*>(std::aligned_alloc(kAlignment, capacity_));
    if (!base_) fail("arena '{}': cannot allocate {}", name_, format_size(capacity_));
    std::memset(base_, 0, capacity_);
  }
}

Arena::~Arena() { std::free(base_); }

void* Arena::allocate_bytes(std::string_view what, std::size_t bytes) {
  std::size_t need = footprint(bytes);
  if (need > remaining())
    fail("arena '{}': region '{}' needs {}, only {} of {} left", name_, what, format_size(bytes),
         format_size(remaining()), format_size(capacity_));
  void* p = base_ + used_;
  regions_.push_back(Region{std::string(what), used_, bytes});
  used_ += need;
  return p;
}

Tensor Arena::tensor(std::string_view what, std::initializer_list<std::int64_t> shape) {
  Tensor probe(nullptr, shape);  // validates the shape
  float* p = allocate<float>(what, static_cast<std::size_t>(probe.numel()));
  return Tensor(p, shape);
}

void Arena::reset() {
  used_ = 0;
  regions_.clear();
}

void Arena::zero_used() {
  if (used_) std::memset(base_, 0, used_);
}

const Arena::Region* Arena::find(const void* p) const {
  auto* b = static_cast<const std::byte*>(p);
  if (b < base_ || b >= base_ + used_) return nullptr;
  std::size_t off = static_cast<std::size_t>(b - base_);
  for (const Region& r : regions_)
    if (off >= r.offset && off < r.offset + footprint(r.bytes)) return &r;
  return nullptr;
}

Tensor ArenaPlanner::tensor(std::string_view what, std::initializer_list<std::int64_t> shape) {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  if (!arena_) {
    counted_ += Arena::footprint(static_cast<std::size_t>(n) * sizeof(float));
    return {};
  }
  return arena_->tensor(what, shape);
}

void* ArenaPlanner::bytes(std::string_view what, std::size_t n) {
  if (!arena_) {
    counted_ += Arena::footprint(n);
    return nullptr;
  }
  return arena_->allocate_bytes(what, n);
}

}  // namespace keel

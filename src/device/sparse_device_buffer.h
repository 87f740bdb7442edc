// One range of device addresses of which only some parts are backed by memory (CUDA virtual
// memory management: reserve the addresses, map physical memory where asked). Code keeps
// indexing one flat buffer by global offsets while a rank pays only for the parts it uses;
// touching an unbacked part is an illegal-address fault, not a silent wrong value.
//
// ZeRO-1's fp32 master weights use it: a rank keeps the masters of its own shard and of the
// small parameters every forward reads in fp32, and the bf16 copy serves the rest.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace keel {

struct ByteRange {
  std::size_t begin = 0, end = 0;  // [begin, end)
};

class SparseDeviceBuffer {
 public:
  // Reserves `bytes` of addresses on the current device and backs the union of `backed`,
  // each range rounded out to the allocation granularity (2 MiB on Hopper) and clipped to the
  // reservation. When the union covers everything it is one plain cudaMalloc. Backed memory
  // starts zeroed. Out of memory: throw_out_of_gpu_memory(need, backed bytes, advice).
  SparseDeviceBuffer(std::size_t bytes, std::vector<ByteRange> backed, const std::string& need,
                     const std::string& advice);
  ~SparseDeviceBuffer();
  SparseDeviceBuffer(const SparseDeviceBuffer&) = delete;
  SparseDeviceBuffer& operator=(const SparseDeviceBuffer&) = delete;

  void* get() const { return base_; }
  std::size_t size() const { return bytes_; }
  bool whole() const { return whole_; }  // every byte is backed
  std::size_t backed_bytes() const;
  // The backed parts, ascending and disjoint (granularity-rounded; the whole buffer when whole()).
  const std::vector<ByteRange>& backed() const { return mapped_; }

 private:
  void release() noexcept;

  std::size_t bytes_ = 0, reserved_ = 0;
  bool whole_ = false;
  void* base_ = nullptr;
  std::vector<ByteRange> mapped_;
};

// The ascending, disjoint union of `ranges` with each range rounded out to multiples of
// `granularity` and clipped to [0, limit); empty ranges dropped. (Host-side, testable on CPU.)
std::vector<ByteRange> round_and_merge(std::vector<ByteRange> ranges, std::size_t granularity, std::size_t limit);

}  // namespace keel

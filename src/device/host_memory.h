// Host memory that device copies are fast into, and the copy itself: the seam the checkpoint
// saver stages through, so it needs no CUDA headers (a HIP port changes host_memory.cc only).
#pragma once

#include <cstddef>

namespace keel {

// A host buffer, page-locked when a GPU is visible in a CUDA build (device-to-host copies then
// run at full PCIe/NVLink-C2C rate instead of through a bounce buffer), plain otherwise.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t bytes, bool pinned);
  ~HostBuffer();
  HostBuffer(HostBuffer&& o) noexcept;
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  char* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool pinned() const { return pinned_; }

 private:
  char* data_ = nullptr;
  std::size_t size_ = 0;
  bool pinned_ = false;
};

// True when pinned buffers are available (a CUDA build with a visible GPU).
bool pinned_host_memory_available();

// Copies n bytes to host memory `dst` from `src`: device memory of the current GPU when
// `from_device` (synchronous; the caller has synchronized the stream that wrote it), else host
// memory. Throws keel::Error on a CUDA error, and for device memory in a CPU-only build.
void copy_to_host(void* dst, const void* src, std::size_t n, bool from_device);

}  // namespace keel

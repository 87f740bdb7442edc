#include <cuda.h>
#include <cuda_runtime.h>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/device_buffer.h"
#include "device/sparse_device_buffer.h"

namespace keel {
namespace {

// Driver entry points through the runtime, so keel needs no link-time libcuda (the CI machine
// has the toolkit but no driver). A HIP port maps these to hipMem* of the same shape.
struct Driver {
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) free_addresses = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;

  template <typename F>
  static void load(F& fn, const char* name) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    KEEL_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q));
    if (!p || q != cudaDriverEntryPointSuccess) fail("the CUDA driver has no {} (virtual memory management)", name);
    fn = reinterpret_cast<F>(p);
  }
  static const Driver& get() {
    static const Driver d = [] {
      Driver x;
      load(x.granularity, "cuMemGetAllocationGranularity");
      load(x.reserve, "cuMemAddressReserve");
      load(x.free_addresses, "cuMemAddressFree");
      load(x.create, "cuMemCreate");
      load(x.release, "cuMemRelease");
      load(x.map, "cuMemMap");
      load(x.unmap, "cuMemUnmap");
      load(x.set_access, "cuMemSetAccess");
      return x;
    }();
    return d;
  }
};

void check(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) fail("CUDA driver call {} failed: error {}", call, static_cast<int>(r));
}

}  // namespace

SparseDeviceBuffer::SparseDeviceBuffer(std::size_t bytes, std::vector<ByteRange> backed, const std::string& need,
                                       const std::string& advice)
    : bytes_(bytes) {
  const std::size_t want = std::max<std::size_t>(bytes, 256);
  // Whole when the asked-for ranges cover [0, bytes) without rounding.
  const std::vector<ByteRange> exact = round_and_merge(backed, 1, bytes);
  whole_ = bytes == 0 || (exact.size() == 1 && exact[0].begin == 0 && exact[0].end == bytes);
  if (whole_) {
    if (cudaMalloc(&base_, want) != cudaSuccess) {
      base_ = nullptr;
      throw_out_of_gpu_memory(need, want, advice);
    }
    reserved_ = want;
    mapped_ = {{0, want}};
    KEEL_CUDA_CHECK(cudaMemset(base_, 0, want));
    return;
  }
  const Driver& d = Driver::get();
  int device = 0;
  KEEL_CUDA_CHECK(cudaGetDevice(&device));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  std::size_t g = 0;
  check(d.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  reserved_ = (want + g - 1) / g * g;
  CUdeviceptr base = 0;
  check(d.reserve(&base, reserved_, g, 0, 0), "cuMemAddressReserve");
  base_ = reinterpret_cast<void*>(base);
  const std::vector<ByteRange> parts = round_and_merge(std::move(backed), g, reserved_);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  try {
    for (const ByteRange& r : parts) {
      CUmemGenericAllocationHandle h{};
      const CUresult made = d.create(&h, r.end - r.begin, &prop, 0);
      if (made == CUDA_ERROR_OUT_OF_MEMORY) {
        std::size_t total = 0;
        for (const ByteRange& p : parts) total += p.end - p.begin;
        throw_out_of_gpu_memory(need, total, advice);
      }
      check(made, "cuMemCreate");
      const CUresult mapped = d.map(base + r.begin, r.end - r.begin, 0, h, 0);
      d.release(h);  // the mapping keeps the memory until it is unmapped
      check(mapped, "cuMemMap");
      mapped_.push_back(r);
      check(d.set_access(base + r.begin, r.end - r.begin, &access, 1), "cuMemSetAccess");
      KEEL_CUDA_CHECK(cudaMemset(static_cast<std::byte*>(base_) + r.begin, 0, r.end - r.begin));
    }
  } catch (...) {
    release();  // the constructor did not finish: no destructor will run
    throw;
  }
}

SparseDeviceBuffer::~SparseDeviceBuffer() { release(); }

void SparseDeviceBuffer::release() noexcept {
  if (!base_) return;
  if (whole_) {
    cudaFree(base_);
  } else {
    cudaDeviceSynchronize();  // no kernel may still touch the memory being unmapped
    const Driver& d = Driver::get();
    const auto base = reinterpret_cast<CUdeviceptr>(base_);
    for (const ByteRange& r : mapped_) d.unmap(base + r.begin, r.end - r.begin);
    d.free_addresses(base, reserved_);
  }
  base_ = nullptr;
  mapped_.clear();
}

std::size_t SparseDeviceBuffer::backed_bytes() const {
  std::size_t n = 0;
  for (const ByteRange& r : mapped_) n += r.end - r.begin;
  return n;
}

}  // namespace keel

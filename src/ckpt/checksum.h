// CRC32C (Castagnoli): keel's own checksum for stored shards. On x86-64 CPUs with SSE4.2 the
// CPU's crc32 instruction (10.8 against the table's 2.3 GB/s on one core of the development
// machine: a 25 GB checkpoint's sums, which a restart and every save wait on, in seconds);
// elsewhere table-driven slicing-by-8.
#pragma once

#include <cstddef>
#include <cstdint>

namespace keel::ckpt {

// Extends `crc` (0 to start) over `n` bytes; crc32c(0, "123456789", 9) == 0xE3069283.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n);

// The table-driven form alone (what crc32c uses without the instruction): for tests.
std::uint32_t crc32c_table(std::uint32_t crc, const void* data, std::size_t n);

// Whether crc32c uses the CPU's instruction on this machine.
bool crc32c_hardware();

}  // namespace keel::ckpt

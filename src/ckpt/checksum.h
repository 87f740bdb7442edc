// CRC32C (Castagnoli), table-driven slicing-by-8: keel's own checksum for stored shards.
#pragma once

#include <cstddef>
#include <cstdint>

namespace keel::ckpt {

// Extends `crc` (0 to start) over `n` bytes; crc32c(0, "123456789", 9) == 0xE3069283.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n);

}  // namespace keel::ckpt

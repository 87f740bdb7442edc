#include <algorithm>

#include "device/sparse_device_buffer.h"

namespace keel {

std::vector<ByteRange> round_and_merge(std::vector<ByteRange> ranges, std::size_t granularity, std::size_t limit) {
  const std::size_t g = std::max<std::size_t>(granularity, 1);
  std::vector<ByteRange> rounded;
  for (const ByteRange& r : ranges) {
    if (r.end <= r.begin) continue;
    const std::size_t b = r.begin / g * g, e = std::min((r.end + g - 1) / g * g, limit);
    if (b < e) rounded.push_back({b, e});
  }
  std::sort(rounded.begin(), rounded.end(), [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  std::vector<ByteRange> out;
  for (const ByteRange& r : rounded) {
    if (!out.empty() && r.begin <= out.back().end) out.back().end = std::max(out.back().end, r.end);
    else out.push_back(r);
  }
  return out;
}

}  // namespace keel

#include "hw/hardware.h"

#include <algorithm>
#include <cctype>

namespace keel::hw {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

const std::vector<HardwareProfile>& builtin_profiles() {
  // Vendor datasheet figures (dense, without sparsity). Link bandwidth: NVLink per GPU per
  // direction (A100 300, H100/H200 450, B200 900 GB/s); MI300X/MI325X: 7 xGMI links x 64 GB/s.
  // MAMF (last column): ml-engineering compute/accelerator/README.md, bf16 max achievable
  // matmul FLOPS (H100 794.5, "H200 is the same", A100 271.2, B200 1745, MI300X 668.4 with
  // TunableOp on ROCm 6.3, MI325X 784.9).
  static const std::vector<HardwareProfile> profiles = {
      {"h100", "NVIDIA H100 SXM 80GB", 989.4, 989.4, 1978.9, 494.7, 66.9, 3.35, 80, 132, 50, 450, 794.5},
      {"h200", "NVIDIA H200 SXM 141GB", 989.4, 989.4, 1978.9, 494.7, 66.9, 4.8, 141, 132, 50, 450, 794.5},
      {"b200", "NVIDIA B200 SXM 180GB", 2250, 2250, 4500, 1100, 75, 8.0, 180, 148, 126, 900, 1745},
      {"a100", "NVIDIA A100 SXM 80GB", 312, 312, 0, 156, 19.5, 2.039, 80, 108, 40, 300, 271.2},
      {"mi300x", "AMD Instinct MI300X 192GB", 1307.4, 1307.4, 2614.9, 653.7, 163.4, 5.3, 192, 304, 256, 448, 668.4},
      {"mi325x", "AMD Instinct MI325X 256GB", 1307.4, 1307.4, 2614.9, 653.7, 163.4, 6.0, 256, 304, 256, 448, 784.9},
  };
  return profiles;
}

const HardwareProfile* find_profile(std::string_view name) {
  std::string key = lower(name);
  for (const char* suffix : {"-sxm", "_sxm", " sxm", "-sxm5", "-80gb", "-141gb"}) {
    const std::string s(suffix);
    if (key.size() > s.size() && key.compare(key.size() - s.size(), s.size(), s) == 0) key.resize(key.size() - s.size());
  }
  for (const auto& p : builtin_profiles())
    if (p.name == key) return &p;
  return nullptr;
}

const HardwareProfile* match_device_name(std::string_view device_name) {
  const std::string n = lower(device_name);
  // Longest key first so "mi325x" is not taken for another.
  const HardwareProfile* best = nullptr;
  for (const auto& p : builtin_profiles())
    if (n.find(p.name) != std::string::npos && (!best || p.name.size() > best->name.size())) best = &p;
  return best;
}

}  // namespace keel::hw

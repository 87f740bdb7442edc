#include "common/host.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

namespace keel {
namespace {

std::uint64_t pages_bytes(int name) {
  const long pages = ::sysconf(name), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

}  // namespace

std::string host_name() {
  if (const char* slurm = std::getenv("SLURMD_NODENAME"); slurm && *slurm) return slurm;
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::string host_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "cpu";
}

std::optional<std::uint64_t> host_mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  unsigned long long kib = 0;
  while (std::getline(in, line))
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) return static_cast<std::uint64_t>(kib) * 1024;
  return std::nullopt;
}

std::uint64_t host_available_bytes() { return host_mem_available_bytes().value_or(pages_bytes(_SC_AVPHYS_PAGES)); }

std::uint64_t host_last_level_cache_bytes() {
  const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE), l2 = ::sysconf(_SC_LEVEL2_CACHE_SIZE);
  return static_cast<std::uint64_t>(l3 > 0 ? l3 : (l2 > 0 ? l2 : 0));
}

std::uint64_t host_physical_bytes() { return pages_bytes(_SC_PHYS_PAGES); }

}  // namespace keel

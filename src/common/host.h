// What this host has: its name, its CPU's name and its memory, read from /proc and sysconf.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace keel {

// This machine's name: under Slurm the node's name as the scheduler knows it (SLURMD_NODENAME,
// what srun --exclude takes), else its host name (gethostname), or "localhost" when it has none.
std::string host_name();

// /proc/cpuinfo's "model name", or "cpu" when there is none.
std::string host_cpu_model();

// MemAvailable of /proc/meminfo: what the kernel can hand out without swapping (nullopt when
// the kernel does not report it).
std::optional<std::uint64_t> host_mem_available_bytes();
// The same, else the free pages (sysconf).
std::uint64_t host_available_bytes();
// The last-level cache (L3, else L2; sysconf), 0 when unknown.
std::uint64_t host_last_level_cache_bytes();
// Physical memory (sysconf), 0 when unknown.
std::uint64_t host_physical_bytes();

}  // namespace keel

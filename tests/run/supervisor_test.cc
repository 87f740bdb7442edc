// Where keel run's ranks write their heartbeats (run/supervisor.h heartbeat_dir): on one node a
// directory of the node's memory file system, named after this keel run; on several nodes, or
// without a writable local root, the output directory's .heartbeat, which every node sees.
#include "run/supervisor.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace keel::run {
namespace {

namespace fs = std::filesystem;

TEST(RunHeartbeatDir, OneNodeUsesTheLocalMemoryFileSystemSeveralTheOutputDirectory) {
  const fs::path local = fs::temp_directory_path() / ("keel_shm_" + std::to_string(::getpid()));
  fs::remove_all(local);
  fs::create_directories(local);
  const std::string out = "/runs/a";
  EXPECT_EQ(heartbeat_dir(out, false, local.string()), (local / ("keel-run-" + std::to_string(::getpid()))).string());
  EXPECT_EQ(heartbeat_dir(out, true, local.string()), "/runs/a/.heartbeat");
  EXPECT_EQ(heartbeat_dir(out, false, (local / "missing").string()), "/runs/a/.heartbeat");
  EXPECT_EQ(heartbeat_dir(out, false, ""), "/runs/a/.heartbeat");
  if (::geteuid() != 0) {  // root writes anywhere
    ::chmod(local.c_str(), 0500);
    EXPECT_EQ(heartbeat_dir(out, false, local.string()), "/runs/a/.heartbeat");
    ::chmod(local.c_str(), 0700);
  }
  fs::remove_all(local);
}

}  // namespace
}  // namespace keel::run

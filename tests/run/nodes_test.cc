// keel run's nodes (run/nodes.h): the host file read and written without excluded nodes, and
// the launchers' arguments.
#include "run/nodes.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"

namespace keel::run {
namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("keel_nodes_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(RunNodes, HostFileWithoutTheExcludedNodes) {
  const fs::path d = temp_dir("hostfile");
  std::ofstream(d / "hosts") << "# the job's nodes\nnode01 slots=8\n\nnode02 slots=8 # flaky?\nnode03 slots=8\n";
  EXPECT_EQ(read_hostfile((d / "hosts").string()), (std::vector<std::string>{"node01", "node02", "node03"}));
  write_hostfile_without((d / "hosts").string(), {"node02"}, (d / "left").string());
  EXPECT_EQ(read(d / "left"), "# the job's nodes\nnode01 slots=8\n\nnode03 slots=8\n");
  EXPECT_EQ(read_hostfile((d / "left").string()), (std::vector<std::string>{"node01", "node03"}));
  // a node name that only starts like another's is not taken for it
  write_hostfile_without((d / "hosts").string(), {"node0"}, (d / "same").string());
  EXPECT_EQ(read_hostfile((d / "same").string()).size(), 3u);
  fs::remove_all(d);
}

TEST(RunNodes, BadHostFilesAreOneError) {
  const fs::path d = temp_dir("bad");
  try {
    read_hostfile((d / "missing").string());
    FAIL() << "a missing host file was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--hosts " + (d / "missing").string() + ": cannot read"), std::string::npos)
        << e.what();
  }
  std::ofstream(d / "empty") << "# nothing\n\n";
  EXPECT_THROW(read_hostfile((d / "empty").string()), Error);
  std::ofstream(d / "one") << "node01 slots=2\n";
  try {
    write_hostfile_without((d / "one").string(), {"node01"}, (d / "none").string());
    FAIL() << "wrote a host file with no host";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no host is left"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(d / "none"));
  fs::remove_all(d);
}

TEST(RunNodes, LaunchArguments) {
  EXPECT_TRUE(launch_args("mpirun", 1, "", {}).empty());  // keel train alone
  EXPECT_EQ(launch_args("mpirun", 4, "", {}),
            (std::vector<std::string>{"mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none"}));
  EXPECT_EQ(launch_args("mpirun", 8, "h", {"node02"}),
            (std::vector<std::string>{"mpirun", "-np", "8", "--oversubscribe", "--bind-to", "none", "--hostfile", "h"}));
  EXPECT_EQ(launch_args("srun", 1, "", {}), (std::vector<std::string>{"srun", "--ntasks=1", "--kill-on-bad-exit=1"}));
  EXPECT_EQ(launch_args("srun", 16, "", {"node02", "node07"}),
            (std::vector<std::string>{"srun", "--ntasks=16", "--kill-on-bad-exit=1", "--exclude=node02,node07"}));
}

}  // namespace
}  // namespace keel::run

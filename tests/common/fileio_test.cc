// keel's small file helpers (src/common/fileio.h): whole-file reads that fail with the path
// named, for a directory as for a missing file, instead of returning empty text.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/error.h"
#include "common/fileio.h"
#include "../error_message.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

std::string read_error(const std::string& path) {
  return test::error_message([&] { read_file(path); }, "(no error)");
}

TEST(Fileio, ReadFileRoundTripsBytesIncludingNul) {
  const fs::path dir = fs::temp_directory_path() / "keel_fileio_test";
  fs::create_directories(dir);
  const std::string path = (dir / "bytes.bin").string();
  const std::string bytes("a\0b\nc", 5);
  write_file_atomically(path, bytes);
  EXPECT_EQ(read_file(path), bytes);
}

TEST(Fileio, ReadFileOfADirectoryIsAnErrorNamingIt) {
  const fs::path dir = fs::temp_directory_path() / "keel_fileio_test_dir";
  fs::create_directories(dir);
  EXPECT_EQ(read_error(dir.string()), "cannot read " + dir.string() + ": Is a directory");
}

TEST(Fileio, ReadFileOfAMissingFileNamesIt) {
  const std::string path = (fs::temp_directory_path() / "keel_fileio_no_such_file").string();
  EXPECT_EQ(read_error(path), "cannot read " + path + ": No such file or directory");
}

TEST(Fileio, WhyNoNewFileProbesWithoutTouchingAnything) {
  const fs::path dir = fs::temp_directory_path() / "keel_fileio_test_probe";
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_EQ(why_no_new_file((dir / "probe").string()), "");
  EXPECT_TRUE(fs::is_empty(dir)) << "the probe must be removed";
  EXPECT_EQ(why_no_new_file((dir / "missing" / "probe").string()), "No such file or directory");
  write_file_atomically((dir / "kept").string(), "data");
  EXPECT_EQ(why_no_new_file((dir / "kept").string()), "File exists");
  EXPECT_EQ(read_file((dir / "kept").string()), "data");
}

// Issue 34: `keel train /dev/zero` read until the OOM killer. Config files are refused before
// anything is read when they cannot be one: devices, pipes, directories, files over the bound.
TEST(Fileio, ReadConfigFileRefusesWhatCannotBeAConfigBeforeReading) {
  auto error = [](const std::string& path, std::uint64_t max = kMaxConfigBytes) {
    return test::error_message([&] { read_config_file(path, max); }, "(no error)");
  };
  EXPECT_EQ(error("/dev/zero"), "cannot read /dev/zero: it is a character device, not a config file");
  const fs::path dir = fs::temp_directory_path() / ("keel_fileio_config_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_EQ(error(dir.string()), "cannot read " + dir.string() + ": it is a directory, not a config file");
  // a FIFO with no writer: refused at once, not waited on
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error(fifo), "cannot read " + fifo + ": it is a pipe, not a config file");
  // a sparse file one byte over 16 MiB: refused from its size, nothing read or allocated
  const std::string big = (dir / "big.yaml").string();
  write_file_atomically(big, "");
  fs::resize_file(big, kMaxConfigBytes + 1);
  EXPECT_EQ(error(big), "cannot read " + big + ": 16777217 bytes is too large for a config file (at most 16 MiB): is it the "
                        "right file?");
  // the bound itself: a file of exactly max_bytes is read, one more byte is refused
  const std::string small = (dir / "small.yaml").string();
  write_file_atomically(small, "a: 1");
  EXPECT_EQ(read_config_file(small, 4), "a: 1");
  EXPECT_EQ(error(small, 3), "cannot read " + small + ": 4 bytes is too large for a config file (at most 3 B): is it the "
                             "right file?");
  EXPECT_EQ(error((dir / "missing").string()), "cannot read " + (dir / "missing").string() + ": No such file or directory");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace keel

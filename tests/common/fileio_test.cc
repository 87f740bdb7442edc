// keel's small file helpers (src/common/fileio.h): whole-file reads that fail with the path
// named, for a directory as for a missing file, instead of returning empty text.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace keel

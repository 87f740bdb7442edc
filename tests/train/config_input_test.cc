// Issue 34, the train config's bad input: strings that are not UTF-8 (accepted, then the run
// died at its first checkpoint commit in nlohmann's "invalid UTF-8 byte", naming no key), YAML
// alias bombs (minutes of CPU) and files that are no config (`keel train /dev/zero` read until
// the OOM killer). Each is refused at load with one line naming the file and the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fileio.h"  // write_file_atomically
#include "train/train_config.h"

#include "train_test_util.h"
#include "../error_message.h"
#include "../common/alias_bomb.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;
using fixtures::expect_usage_error;

const std::string kUtf8Tail = "; configs are stored in checkpoints as JSON, which needs UTF-8";

// 9 aliases of 9 aliases, 8 levels: 43 million values from under 400 bytes.
std::string alias_bomb() { return test::alias_bomb(8); }

std::string parse_error(const std::string& text, const std::vector<std::string>& sets = {}) {
  return test::error_message<UsageError>([&] { parse_train_config(text, "bad.yaml", sets); }, "(no error)");
}

TEST(TrainConfigInput, NonUtf8StringsAreRefusedAtLoadNamingTheKey) {
  const auto dir = fixtures::temp_dir("train_config_input", "utf8");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  ASSERT_EQ(parse_error(good), "(no error)");
  // in the file: the model's name (Latin-1 'é'), with its line
  std::string latin1 = good;
  latin1.replace(latin1.find("  vocab_size: 24\n"), 16, "  name: caf\xe9\n  vocab_size: 24\n");
  const int line = 1 + static_cast<int>(std::count(latin1.begin(), latin1.begin() + latin1.find("  name:"), '\n'));
  EXPECT_EQ(parse_error(latin1), fmt::format("bad.yaml: key 'model.name' (line {}) is not valid UTF-8 (byte 0xe9 at "
                                             "offset 3 starts no valid character){}",
                                             line, kUtf8Tail));
  // from --set: a path, and a dataset name (a key)
  EXPECT_EQ(parse_error(good, {"output_dir=out/\xff"}),
            "bad.yaml (--set output_dir): key 'output_dir' is not valid UTF-8 (byte 0xff at offset 4)" + kUtf8Tail);
  EXPECT_EQ(parse_error(good, {"data.datasets.w\xff=" + prefix}),
            "bad.yaml: the name of key 'data.datasets.w\\xff' is not valid UTF-8 (byte 0xff at offset 1)" + kUtf8Tail);
  // valid UTF-8 beyond ASCII passes
  EXPECT_EQ(parse_error(good, {"model.name=Gr\xc3\xbc\xc3\x9f" "e-\xe4\xb8\x96"}), "(no error)");
}

TEST(TrainConfigInput, AliasBombsAreRefusedWithoutExpandingThem) {
  const auto dir = fixtures::temp_dir("train_config_input", "bomb");
  const auto prefix = fixtures::make_dataset(dir, "d");
  const std::string good = fixtures::train_config_text(prefix, dir / "out");
  const std::string bomb = alias_bomb();
  ASSERT_LT(bomb.size(), 400u);
  const std::string refused =
      "more than 1000000 values with its aliases expanded (aliases nested inside aliases?); a keel config holds a "
      "few hundred";
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(parse_error(good + bomb), "bad.yaml: " + refused);
  // a --set value is bounded before it is copied (the copy would expand it)
  std::string flow = "[&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]";
  for (char c = 'b'; c <= 'g'; ++c) {
    const std::string p = std::string("*") + static_cast<char>(c - 1);
    flow += std::string(", &") + c + " [" + p;
    for (int k = 1; k < 10; ++k) flow += ", " + p;
    flow += "]";
  }
  flow += "]";
  EXPECT_EQ(parse_error(good, {"output_dir=" + flow}), "bad.yaml (--set output_dir): " + refused);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

TEST(TrainConfigInput, FilesThatAreNoConfigAreRefusedBeforeReading) {
  auto load_error = [](const std::string& path) {
    return test::error_message<UsageError>([&] { load_train_config(path); }, "(no error)");
  };
  EXPECT_EQ(load_error("/dev/zero"), "cannot read /dev/zero: it is a character device, not a config file");
  const auto dir = fixtures::temp_dir("train_config_input", "files");
  EXPECT_EQ(load_error(dir.string()), "cannot read " + dir.string() + ": it is a directory, not a config file");
  // sparse: refused from its size, nothing read
  const std::string big = (dir / "big.yaml").string();
  write_file_atomically(big, "");
  fs::resize_file(big, (std::uint64_t{16} << 20) + 4096);  // 16 MiB: the bound
  EXPECT_EQ(load_error(big), "cannot read " + big + ": 16781312 bytes is too large for a config file (at most 16 MiB): is it "
                             "the right file?");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace keel::train

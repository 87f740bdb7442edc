// reject_duplicate_keys: a key repeated in any mapping of a YAML document is one clear error.
#include "common/yaml_checks.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "common/error.h"
#include "../error_message.h"
#include "alias_bomb.h"

namespace keel {
namespace {

std::string duplicate_error(const std::string& yaml) {
  return test::error_message<UsageError>([&] { reject_duplicate_keys(YAML::Load(yaml), "c.yaml"); });
}

TEST(YamlChecks, RepeatedKeysAnywhereAreNamedWithTheirLines) {
  EXPECT_EQ(duplicate_error("a: 1\nb: 2\na: 3\n"), "c.yaml: key 'a' appears twice (lines 1 and 3)");
  EXPECT_EQ(duplicate_error("opt:\n  lr: 1\n  beta: 2\n  lr: 3\n"), "c.yaml: key 'opt.lr' appears twice (lines 2 and 4)");
  EXPECT_EQ(duplicate_error("phases:\n  - w: 1\n  - w: 2\n    w: 3\n"),
            "c.yaml: key 'phases[1].w' appears twice (lines 3 and 4)");
  EXPECT_EQ(duplicate_error("{x: {y: 1, y: 2}}"), "c.yaml: key 'x.y' appears twice (lines 1 and 1)");
}

TEST(YamlChecks, DistinctKeysPass) {
  EXPECT_EQ(duplicate_error("a: 1\nb: {a: 2}\nc: [{a: 3}, {a: 4}]\n"), "");
  EXPECT_EQ(duplicate_error("just a scalar"), "");
}

TEST(YamlChecks, LineSuffixOnlyForNodesFromAFile) {
  EXPECT_EQ(yaml_line_suffix(YAML::Load("a: 1\nb: 2\n")["b"]), " (line 2)");
  EXPECT_EQ(yaml_line_suffix(YAML::Node(5)), "");
}

// A "billion laughs" document: 9 aliases of 9 aliases ... 9 levels deep, 10^9 values expanded
// from about 300 bytes. Walking it whole took minutes; the walk stops at kMaxYamlNodes.
std::string alias_bomb() { return test::alias_bomb(9); }

TEST(YamlChecks, AliasBombIsRefusedWithoutExpandingIt) {
  const std::string bomb = alias_bomb();
  ASSERT_LT(bomb.size(), 400u);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(test::error_message<UsageError>([&] { check_yaml_document(YAML::Load(bomb), "c.yaml"); }),
            "c.yaml: more than 1000000 values with its aliases expanded (aliases nested inside aliases?); a keel "
            "config holds a few hundred");
  // reject_duplicate_keys walks the same way
  EXPECT_NE(test::error_message<UsageError>([&] { reject_duplicate_keys(YAML::Load(bomb), "c.yaml"); }), "");
  // a generous bound: the refusal walks 10^6 nodes, the whole document 10^9
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  // aliases used sparingly are fine
  EXPECT_EQ(test::error_message<UsageError>([] { check_yaml_document(YAML::Load("a: &a [1, 2]\nb: *a\n"), "c.yaml"); }),
            "");
}

TEST(YamlChecks, Utf8FollowsRfc3629) {
  EXPECT_EQ(why_not_utf8("plain ascii"), "");
  EXPECT_EQ(why_not_utf8("Gr\xc3\xbc\xc3\x9f" "e \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf"), "");
  EXPECT_EQ(why_not_utf8("ab\xff"), "byte 0xff at offset 2");
  EXPECT_EQ(why_not_utf8("caf\xe9 noir"), "byte 0xe9 at offset 3 starts no valid character");  // Latin-1
  EXPECT_EQ(why_not_utf8("\xc0\x80"), "byte 0xc0 at offset 0");                               // overlong NUL
  EXPECT_EQ(why_not_utf8("\xe0\x80\xaf"), "byte 0xe0 at offset 0 starts no valid character");  // overlong '/'
  EXPECT_EQ(why_not_utf8("x\xed\xa0\x80"), "byte 0xed at offset 1 starts no valid character"); // a surrogate
  EXPECT_EQ(why_not_utf8("\xf4\x90\x80\x80"), "byte 0xf4 at offset 0 starts no valid character"); // past U+10FFFF
  EXPECT_EQ(why_not_utf8("\xe4\xb8"), "byte 0xe4 at offset 0 starts no valid character");      // cut short
  EXPECT_EQ(why_not_utf8("\x80"), "byte 0x80 at offset 0");                                   // a lone continuation
  EXPECT_EQ(escape_bytes("a\xff\nb"), "a\\xff\\x0ab");
}

TEST(YamlChecks, NonUtf8KeysAndValuesAreNamedWithTheirLines) {
  auto error = [](const std::string& yaml) {
    return test::error_message<UsageError>([&] { check_yaml_document(YAML::Load(yaml), "c.yaml"); });
  };
  const std::string tail = "; configs are stored in checkpoints as JSON, which needs UTF-8";
  EXPECT_EQ(error("model:\n  name: \"moe-\xff\"\n"),
            "c.yaml: key 'model.name' (line 2) is not valid UTF-8 (byte 0xff at offset 4)" + tail);
  EXPECT_EQ(error("data:\n  datasets:\n    web\xff: tokens/web\n"),
            "c.yaml: the name of key 'data.datasets.web\\xff' (line 3) is not valid UTF-8 (byte 0xff at offset 3)" +
                tail);
  EXPECT_EQ(error("paths: [ok, \"caf\xe9\"]\n"),
            "c.yaml: key 'paths[1]' (line 1) is not valid UTF-8 (byte 0xe9 at offset 3 starts no valid character)" +
                tail);
  // a value checked where a --set puts it: no line
  EXPECT_EQ(test::error_message<UsageError>([] { check_yaml_document(YAML::Node("x\xff"), "c.yaml", "output_dir"); }),
            "c.yaml: key 'output_dir' is not valid UTF-8 (byte 0xff at offset 1)" + tail);
  EXPECT_EQ(error("model:\n  name: \"Gr\xc3\xbc\xc3\x9f" "e\"\n"), "");
}

}  // namespace
}  // namespace keel

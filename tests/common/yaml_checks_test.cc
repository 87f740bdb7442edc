// reject_duplicate_keys: a key repeated in any mapping of a YAML document is one clear error.
#include "common/yaml_checks.h"

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "../error_message.h"

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

}  // namespace
}  // namespace keel

#include "mesh/shape.h"

#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "common/error.h"
#include "mesh/placement.h"

namespace keel::mesh {
namespace {

TEST(MeshShape, AxisNamesRoundTrip) {
  std::set<std::string> names;
  for (Axis a : kAxes) {
    names.insert(axis_name(a));
    ASSERT_TRUE(parse_axis(axis_name(a)).has_value());
    EXPECT_EQ(*parse_axis(axis_name(a)), a);
  }
  EXPECT_EQ(names.size(), kAxes.size());
  EXPECT_FALSE(parse_axis("sp").has_value());
}

TEST(MeshShape, ParseAndPrint) {
  bool dp_given = true;
  Shape s = parse("tp=2,ep=4,zero=1", &dp_given);
  EXPECT_FALSE(dp_given);
  EXPECT_EQ(s.tp, 2);
  EXPECT_EQ(s.ep, 4);
  EXPECT_EQ(s.zero, 1);
  fill_data(s, dp_given, 16, "tp=2,ep=4,zero=1");
  EXPECT_EQ(s.dp, 8);
  EXPECT_EQ(s.world(), 16);
  EXPECT_EQ(s.expert_data(), 2);
  EXPECT_EQ(s.str(), "dp=8,tp=2,ep=4,zero=1");
  validate(s, "test");
  EXPECT_EQ(parse(s.str()), s);  // str() parses back to the same shape
  EXPECT_EQ(Shape{}.str(), "dp=1");
}

TEST(MeshShape, BadTextNamesTheKey) {
  auto message = [](const std::string& text) {
    try {
      parse(text);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message("dp=2,dp=4").find("dp is given twice"), std::string::npos);
  EXPECT_NE(message("xp=2").find("unknown axis 'xp'"), std::string::npos);
  EXPECT_NE(message("tp=two").find("tp=two is not an integer"), std::string::npos);
  EXPECT_NE(message("tp=0").find("tp must be at least 1"), std::string::npos);
  EXPECT_NE(message("zero=4").find("zero must be 0, 1, 2 or 3"), std::string::npos);
  EXPECT_NE(message("tp").find("'tp' is not axis=degree"), std::string::npos);
  EXPECT_NE(message("dp=2000000").find("more than the"), std::string::npos);
}

TEST(MeshShape, CombinationsAreCheckedOnce) {
  Shape s = parse("dp=2,ep=3");
  EXPECT_THROW(validate(s, "parallel"), UsageError);
  s = parse("dp=3,cp=2,ep=3");
  EXPECT_NO_THROW(validate(s, "parallel"));
  s = parse("tp=3");
  EXPECT_THROW(fill_data(s, false, 8, "tp=3"), UsageError);  // 3 does not divide 8 ranks
  s = parse("dp=2,tp=2");
  EXPECT_THROW(fill_data(s, true, 8, "dp=2,tp=2"), UsageError);  // spans 4, 8 running
  s = parse("dp=1024,tp=1024,cp=2");
  EXPECT_THROW(validate(s, "parallel"), UsageError);  // beyond kMaxWorld
}

// Every rank has a distinct (pp, dp, cp, tsp, tp) coordinate, tensor groups are consecutive
// ranks, and the expert coordinate runs over ep consecutive ranks of the dp * cp block.
TEST(MeshShape, CoordinatesCoverTheWorldOnce) {
  Shape s = parse("pp=2,dp=3,cp=2,tsp=1,tp=2,ep=3");
  validate(s, "test");
  std::set<std::tuple<int, int, int, int, int>> seen;
  for (int r = 0; r < s.world(); ++r) {
    const Coord c = s.coord(r);
    seen.insert({c.pp, c.dp, c.cp, c.tsp, c.tp});
    EXPECT_EQ((((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.tsp + c.tsp) * s.tp + c.tp, r);
    EXPECT_EQ(c.tp, r % s.tp);
    const int j = c.dp * s.cp + c.cp;
    EXPECT_EQ(c.ep, j % s.ep);
    EXPECT_EQ(c.edp, j / s.ep);
    EXPECT_LT(c.edp, s.expert_data());
    for (Axis a : kAxes) EXPECT_LT(c.on(a), s.degree(a));
  }
  EXPECT_EQ(static_cast<int>(seen.size()), s.world());
}

// The data-parallel ranks of keel train (dp only): the expert coordinate is rank % ep and the
// expert-data coordinate rank / ep, as expert parallelism groups consecutive ranks.
TEST(MeshShape, ExpertGroupsAreConsecutiveDataRanks) {
  Shape s = parse("dp=8,ep=4");
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(s.coord(r).ep, r % 4);
    EXPECT_EQ(s.coord(r).edp, r / 4);
  }
}

TEST(MeshPlacement, LocalShape) {
  const Shape s = parse("dp=4,ep=4,tp=2");
  const Placement experts = Placement::split(3, 0, Axis::kExpert);
  EXPECT_TRUE(experts.splits(Axis::kExpert));
  EXPECT_FALSE(experts.splits(Axis::kTensor));
  EXPECT_EQ(experts.local_shape({16, 64, 32}, s), (std::vector<std::int64_t>{4, 64, 32}));
  Placement both = experts;
  both.dims[1].push_back(Axis::kTensor);
  EXPECT_EQ(both.local_shape({16, 64, 32}, s), (std::vector<std::int64_t>{4, 32, 32}));
  EXPECT_EQ(Placement::replicated(2).local_shape({5, 7}, s), (std::vector<std::int64_t>{5, 7}));
}

}  // namespace
}  // namespace keel::mesh

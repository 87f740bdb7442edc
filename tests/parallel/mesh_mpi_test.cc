// parallel::Mesh on CPU ranks: every group of every shape the world allows has the size and the
// ranks that the mesh vocabulary (mesh/shape.h) gives, its members are exactly the ranks that
// agree on the other coordinates, and a shape that does not span the world is one clear error.
#include "parallel/mesh.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <vector>

#include "../mpi_test_util.h"
#include "common/error.h"

namespace keel::parallel {
namespace {

using keel::test::world_rank;
using keel::test::world_size;

// Every world rank's coordinate in the group's communicator, gathered over it.
std::vector<int> members(const Group& g) {
  std::vector<int> ranks(static_cast<std::size_t>(g.size), world_rank());
  if (g.size > 1) {
    const int me = world_rank();
    MPI_Allgather(&me, 1, MPI_INT, ranks.data(), 1, MPI_INT, g.comm);
  }
  return ranks;
}

// The world ranks that share every coordinate but the group's own, in rank order.
std::vector<int> expected_members(const mesh::Shape& s, GroupKind g) {
  const mesh::Coord me = s.coord(world_rank());
  std::vector<int> out;
  for (int r = 0; r < s.world(); ++r) {
    const mesh::Coord c = s.coord(r);
    const bool same_pp = c.pp == me.pp, same_tp = c.tp == me.tp, same_tsp = c.tsp == me.tsp;
    const bool same_dp = c.dp == me.dp, same_cp = c.cp == me.cp;
    bool in = false;
    switch (g) {
      case GroupKind::kData: in = same_pp && same_tsp && same_tp; break;
      case GroupKind::kExpert: in = same_pp && same_tsp && same_tp && c.edp == me.edp; break;
      case GroupKind::kExpertData: in = same_pp && same_tsp && same_tp && c.ep == me.ep; break;
      case GroupKind::kTensor: in = same_pp && same_dp && same_cp && same_tsp; break;
      case GroupKind::kContext: in = same_pp && same_dp && same_tsp && same_tp; break;
      case GroupKind::kTsp: in = same_pp && same_dp && same_cp && same_tp; break;
      case GroupKind::kPipeline: in = same_dp && same_cp && same_tsp && same_tp; break;
    }
    if (in) out.push_back(r);
  }
  return out;
}

// Every way to factor the world into (pp, dp, cp, tsp, tp) with ep dividing dp * cp.
std::vector<mesh::Shape> shapes(int world) {
  std::vector<mesh::Shape> out;
  for (int pp = 1; pp <= world; ++pp)
    for (int cp = 1; cp <= world; ++cp)
      for (int tsp = 1; tsp <= world; ++tsp)
        for (int tp = 1; tp <= world; ++tp) {
          const int rest = pp * cp * tsp * tp;
          if (world % rest != 0) continue;
          mesh::Shape s;
          s.pp = pp, s.cp = cp, s.tsp = tsp, s.tp = tp, s.dp = world / rest;
          for (int ep = 1; ep <= s.dp * s.cp; ++ep)
            if ((s.dp * s.cp) % ep == 0) {
              s.ep = ep;
              out.push_back(s);
            }
        }
  return out;
}

TEST(Mesh, GroupsAreTheRanksThatShareTheOtherCoordinates) {
  for (const mesh::Shape& s : shapes(world_size())) {
    Mesh m(s, MPI_COMM_WORLD);
    EXPECT_EQ(m.rank(), world_rank());
    EXPECT_EQ(m.size(), world_size());
    const mesh::Coord c = s.coord(world_rank());
    EXPECT_EQ(m.coord().dp, c.dp);
    EXPECT_EQ(m.coord().ep, c.ep);
    for (int k = 0; k < kGroupKinds; ++k) {
      const auto g = static_cast<GroupKind>(k);
      const std::vector<int> want = expected_members(s, g);
      const Group& grp = m.group(g);
      ASSERT_EQ(grp.size, static_cast<int>(want.size())) << s.str() << " " << group_name(g);
      EXPECT_EQ(grp.size == 1, grp.comm == MPI_COMM_NULL) << s.str() << " " << group_name(g);
      EXPECT_EQ(members(grp), want) << s.str() << " " << group_name(g);
      // the group rank is this rank's place among the members (the coordinate on the axis)
      const auto at = std::find(want.begin(), want.end(), world_rank()) - want.begin();
      EXPECT_EQ(grp.rank, static_cast<int>(at)) << s.str() << " " << group_name(g);
    }
    EXPECT_EQ(m.expert().rank, c.ep) << s.str();
    EXPECT_EQ(m.expert_data().rank, c.edp) << s.str();
  }
}

TEST(Mesh, AShapeThatDoesNotSpanTheWorldIsOneError) {
  mesh::Shape s;
  s.dp = world_size() + 1;
  try {
    Mesh m(s, MPI_COMM_WORLD, "train.yaml: parallel");
    FAIL() << "a mesh of " << s.world() << " ranks accepted on " << world_size();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("train.yaml: parallel: the layout dp="), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("but " + std::to_string(world_size()) + " are running"), std::string::npos)
        << e.what();
  }
  s.dp = world_size();
  s.ep = world_size() + 1;  // does not divide dp * cp
  EXPECT_THROW(Mesh(s, MPI_COMM_WORLD), UsageError);
}

TEST(Mesh, CopiesShareTheCommunicators) {
  mesh::Shape s;
  s.dp = world_size();
  s.ep = world_size() % 2 == 0 ? 2 : 1;
  Mesh a(s, MPI_COMM_WORLD);
  const Mesh b = a;
  EXPECT_EQ(a.expert().comm, b.expert().comm);
  EXPECT_EQ(&a.group(GroupKind::kData), &b.group(GroupKind::kData));
  int same = 0;
  if (a.expert().comm != MPI_COMM_NULL) {
    MPI_Comm_compare(a.expert().comm, b.expert().comm, &same);
    EXPECT_EQ(same, MPI_IDENT);
  }
}

}  // namespace
}  // namespace keel::parallel

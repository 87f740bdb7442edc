// parallel::check_plan: the one place a model is checked against a mesh shape.
#include "parallel/plan.h"

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "parallel/tsp_tables.h"

namespace keel::parallel {
namespace {

model::ModelConfig moe(int experts) {
  model::ModelConfig m;
  m.name = "m";
  m.vocab_size = 64, m.hidden = 32, m.layers = 2, m.heads = 4, m.kv_heads = 2, m.head_dim = 8;
  m.experts = experts, m.top_k = 1, m.expert_hidden = 16, m.ffn_hidden = 16;
  return m;
}

std::string error_of(const model::ModelConfig& m, const mesh::Shape& s) {
  try {
    check_plan(m, s, "t.yaml");
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(ParallelPlan, DataAndExpertParallelismPass) {
  mesh::Shape s;
  s.dp = 8;
  s.ep = 4;
  EXPECT_EQ(error_of(moe(8), s), "");
  s.ep = 1;
  EXPECT_EQ(error_of(moe(0), s), "");
}

TEST(ParallelPlan, PipelineIsOneError) {
  mesh::Shape s;
  s.pp = 2;
  const std::string e = error_of(moe(4), s);
  EXPECT_NE(e.find("t.yaml: pipeline parallelism (pp=2) is not implemented yet"), std::string::npos) << e;
}

// TSP slices the weights as tensor parallelism does: the same degrees split, the same refuse
// (naming parallel.tsp), and it does not combine with tp or cp.
TEST(ParallelPlan, TspDegreesSplitAsTensorDegrees) {
  for (int d : {2, 4}) {
    mesh::Shape s;
    s.tsp = d;
    EXPECT_EQ(error_of(moe(4), s), "") << d;
  }
  mesh::Shape three;
  three.tsp = 3;
  EXPECT_NE(error_of(moe(4), three).find("does not split over tsp degree 3 (parallel.tsp)"), std::string::npos)
      << error_of(moe(4), three);
  for (const mesh::Axis other : {mesh::Axis::kTensor, mesh::Axis::kContext}) {
    mesh::Shape s;
    s.tsp = 2;
    s.set(other, 2);
    const std::string e = error_of(moe(4), s);
    EXPECT_NE(e.find(std::string("parallel.tsp (2) with parallel.") + mesh::axis_title(other) + " (2)"),
              std::string::npos)
        << e;
  }
}

TEST(ParallelPlan, TensorDegreesThatSplitPass) {
  for (int tp : {2, 4}) {  // 4: more tensor ranks than the 2 kv heads, which are replicated
    mesh::Shape s;
    s.tp = tp;
    EXPECT_EQ(error_of(moe(4), s), "") << tp;
  }
}

TEST(ParallelPlan, TensorDegreesThatDoNotSplitAreOneError) {
  const auto check = [](model::ModelConfig m, int tp, const std::string& why) {
    mesh::Shape s;
    s.tp = tp;
    const std::string e = error_of(m, s);
    EXPECT_NE(e.find("t.yaml: model 'm' does not split over tensor-parallel degree " + std::to_string(tp)),
              std::string::npos)
        << e;
    EXPECT_NE(e.find(why), std::string::npos) << e;
  };
  check(moe(4), 8, "4 attention heads do not divide by 8");
  model::ModelConfig m = moe(4);
  m.vocab_size = 65;
  check(m, 2, "the vocabulary of 65 does not divide by 2");
  m = moe(4);
  m.expert_hidden = 18;
  check(m, 4, "layer 0's expert_hidden width 18 does not divide by 4");
  m = moe(4);
  m.heads = 6, m.kv_heads = 3, m.head_dim = 4;
  check(m, 2, "3 kv heads");
}

// CCA over more tensor ranks than its kv heads replicates its projections (and attends each
// rank's own query heads); TSP does not.
TEST(ParallelPlan, CcaPastItsKvHeadsReplicatesUnderTensorParallelism) {
  model::ModelConfig m = moe(4);
  m.attention = model::AttentionKind::kCca;
  m.heads = 8, m.kv_heads = 2;
  mesh::Shape s;
  s.tp = 4;
  EXPECT_EQ(error_of(m, s), "");
  s.tp = 1, s.tsp = 4;
  const std::string e = error_of(m, s);
  EXPECT_NE(e.find("does not split over tsp degree 4"), std::string::npos) << e;
  EXPECT_NE(e.find("TSP over more ranks than CCA's 2 kv heads"), std::string::npos) << e;
}

// The all-to-all splits each tensor rank's heads over the context ranks: past the kv heads a
// tensor rank's query heads read one kv head, which does not split over 2.
TEST(ParallelPlan, AllToAllCountsTheKvHeadsATensorRankReads) {
  model::ModelConfig m = moe(4);
  m.heads = 8, m.kv_heads = 2;
  EXPECT_NO_THROW(check_alltoall(m, 2, 1));  // 4 query, 1 kv head per tensor rank; C = 1
  EXPECT_NO_THROW(check_alltoall(m, 1, 2));  // 8 query, 2 kv heads
  for (int tensor : {2, 4}) {                // 1 kv head per tensor rank (at 4: one replicated)
    try {
      check_alltoall(m, tensor, 2);
      ADD_FAILURE() << "accepted tensor " << tensor;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("1 kv heads per tensor rank; both must divide by 2"), std::string::npos)
          << e.what();
    }
  }
}

TEST(ParallelPlan, ExpertsMustSplit) {
  mesh::Shape s;
  s.dp = 6;
  s.ep = 3;
  EXPECT_NE(error_of(moe(4), s).find("4 experts do not split over expert-parallel degree 3"), std::string::npos);
  EXPECT_NE(error_of(moe(0), s).find("0 experts do not split"), std::string::npos);
}

}  // namespace
}  // namespace keel::parallel

namespace keel::parallel {
namespace {

// parallel.tsp_tables: the three words, one line naming a bad one, and auto's rule (gather while
// the micro-batch has at most as many tokens as the vocabulary has rows).
TEST(TspTables, WordsAndTheAutoRule) {
  EXPECT_EQ(parse_tsp_tables("auto"), TspTables::kAuto);
  EXPECT_EQ(parse_tsp_tables("sweep"), TspTables::kSweep);
  EXPECT_EQ(parse_tsp_tables("gather"), TspTables::kGather);
  try {
    parse_tsp_tables("gahter");
    ADD_FAILURE() << "accepted 'gahter'";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'gahter'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(tsp_gathers_tables(TspTables::kAuto, 32768, 262272));
  EXPECT_TRUE(tsp_gathers_tables(TspTables::kAuto, 32000, 32000));
  EXPECT_FALSE(tsp_gathers_tables(TspTables::kAuto, 32001, 32000));
  EXPECT_FALSE(tsp_gathers_tables(TspTables::kAuto, 131072, 32000));
  EXPECT_TRUE(tsp_gathers_tables(TspTables::kGather, 131072, 32000));
  EXPECT_FALSE(tsp_gathers_tables(TspTables::kSweep, 16, 32000));
}

}  // namespace
}  // namespace keel::parallel

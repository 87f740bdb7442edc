// parallel::check_plan: the one place a model is checked against a mesh shape.
#include "parallel/plan.h"

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"

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

TEST(ParallelPlan, EachUnimplementedAxisIsOneError) {
  for (const mesh::Axis a : {mesh::Axis::kTensor, mesh::Axis::kContext, mesh::Axis::kTsp, mesh::Axis::kPipeline}) {
    mesh::Shape s;
    s.set(a, 2);
    const std::string e = error_of(moe(4), s);
    EXPECT_NE(e.find(std::string("t.yaml: ") + mesh::axis_title(a) + " parallelism (" + mesh::axis_name(a) + "=2) is "
                     "not implemented yet"),
              std::string::npos)
        << e;
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

// `bench comm` decisions that need no ranks: the sizes of a series, option validation, the
// --min-busbw gate and the output paths checked before a sweep.
#include "bench/comm/report.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "common/error.h"
#include "../../error_message.h"

namespace keel::bench {
namespace {

namespace fs = std::filesystem;

// The message of what `f` throws; "no error thrown" (which no check below finds) when it returns.
template <typename F>
std::string error_of(F&& f) {
  return test::error_message(std::forward<F>(f), "no error thrown");
}

CommOptions two_rank_options() {
  CommOptions o;
  o.backend = "mpi";
  o.min_bytes = 64;
  o.max_bytes = 4096;
  return o;
}

TEST(CommSizes, NonIntegerFactorsRoundDownToWhatTheOpNeeds) {
  CommOptions o = two_rank_options();
  o.min_bytes = 8;
  o.max_bytes = 64;
  o.factor = 1.5;  // 8, 12, 18, 27, 41, 61: once "18 B is not a multiple of the fp32 element size"
  EXPECT_EQ(case_sizes(o, Collective::kAllReduce, DType::kFP32, 2),
            (std::vector<std::uint64_t>{8, 12, 16, 24, 40, 60}));
  // all_gather over 2 ranks of fp32 needs multiples of 8 B; 12 rounds onto 8 and is dropped.
  EXPECT_EQ(case_sizes(o, Collective::kAllGather, DType::kFP32, 2), (std::vector<std::uint64_t>{8, 16, 24, 40, 56}));
  EXPECT_NO_THROW(validate_options(o, 2));
}

TEST(CommSizes, TypedMinAndMaxMustSplitAsTheyAre) {
  CommOptions o = two_rank_options();
  o.min_bytes = 6;
  o.max_bytes = 48;
  o.factor = 2;
  EXPECT_NE(error_of([&] { case_sizes(o, Collective::kAllReduce, DType::kFP32, 2); }).find("6 B is not a multiple"),
            std::string::npos);
  o.min_bytes = 8;
  o.max_bytes = 8;
  o.ops = {Collective::kAllGather};
  EXPECT_NE(error_of([&] { validate_options(o, 8); }).find("does not split over 8 ranks"), std::string::npos)
      << "an all-gather of 8 B over 8 ranks is still an error";
}

TEST(CommValidate, CollectivesNeedAtLeastTwoRanks) {
  CommOptions o = two_rank_options();
  EXPECT_NE(error_of([&] { validate_options(o, 1); }).find("collectives need at least 2 ranks, but the world has 1"),
            std::string::npos);
  o.ranks = {1, 2};
  EXPECT_NE(error_of([&] { validate_options(o, 4); }).find("collectives need at least 2 ranks, got --ranks 1"),
            std::string::npos);
  o.ranks = {2, 4};
  EXPECT_NO_THROW(validate_options(o, 4));
}

TEST(CommValidate, GateAndTimeoutMustBeNumbers) {
  CommOptions o = two_rank_options();
  for (double bad : {std::nan(""), -1.0, std::numeric_limits<double>::infinity()}) {
    o.min_busbw = bad;
    EXPECT_NE(error_of([&] { validate_options(o, 2); }).find("--min-busbw must be a finite number"), std::string::npos)
        << bad;
  }
  o.min_busbw = 0;
  o.plan.timeout_s = std::nan("");
  EXPECT_THROW(validate_options(o, 2), UsageError);
  o.plan.timeout_s = -1;
  EXPECT_NE(error_of([&] { validate_options(o, 2); }).find("--timeout -1: must be seconds >= 0"), std::string::npos);
  o.plan.timeout_s = std::numeric_limits<double>::infinity();  // no deadline
  EXPECT_NO_THROW(validate_options(o, 2));
  o.plan.timeout_s = 0;  // no deadline too, as in every keel command
  EXPECT_NO_THROW(validate_options(o, 2));
}

// The memory check before the sweep (issue 34): the largest send and receive buffers over every
// case, and the largest message a reducing op moves (MPI's reduction scratch).
TEST(CommMemory, LargestBuffersCoverEveryCase) {
  CommOptions o = two_rank_options();
  o.ops = {Collective::kAllGather, Collective::kBroadcast};
  o.min_bytes = 1024;
  o.max_bytes = 8ull << 30;
  SweepBuffers b = largest_buffers(o, 4);
  EXPECT_EQ(b.send, 8ull << 30);  // broadcast: send = receive = the size
  EXPECT_EQ(b.recv, 8ull << 30);
  EXPECT_EQ(b.reduce, 0u) << "neither op reduces";
  o.ops = {Collective::kAllGather};
  o.ranks = {2, 4};
  b = largest_buffers(o, 4);
  EXPECT_EQ(b.send, 4ull << 30) << "all-gather sends a half at 2 ranks (the largest share)";
  EXPECT_EQ(b.recv, 8ull << 30);
  o.ops = {Collective::kReduceScatter};
  o.ranks = {};
  b = largest_buffers(o, 4);
  EXPECT_EQ(b.send, 8ull << 30);
  EXPECT_EQ(b.recv, 2ull << 30);
  EXPECT_EQ(b.reduce, 8ull << 30);
}

TEST(CommMemory, HostCheckCountsEveryRankOfTheHost) {
  const std::uint64_t G = 1ull << 30;
  const SweepBuffers all_reduce_8g{8 * G, 8 * G, 8 * G};  // --backend mpi -b 8G -e 8G
  // 4 ranks x 24 GiB = 96 GiB against 64 GiB available: refused, naming what to change.
  const std::string msg = host_memory_problem(all_reduce_8g, 4, 64 * G, "node7");
  EXPECT_EQ(msg,
            "bench comm: the sweep needs 96 GiB of host memory on node7: 4 ranks x (8 GiB send + 8 GiB receive "
            "buffers + up to 8 GiB of MPI reduction scratch), but only 64 GiB is available: lower --max (-e) or start "
            "fewer ranks on this host");
  EXPECT_EQ(host_memory_problem(all_reduce_8g, 2, 64 * G, "node7"), "") << "48 GiB fits in 90% of 64";
  EXPECT_NE(host_memory_problem(all_reduce_8g, 2, 50 * G, "node7"), "") << "48 GiB is over 90% of 50";
  // One rank, no reducing op: no scratch, no "fewer ranks".
  EXPECT_EQ(host_memory_problem({G, G, 0}, 1, G, "h"),
            "bench comm: the sweep needs 2 GiB of host memory on h: 1 rank x (1 GiB send + 1 GiB receive buffers), "
            "but only 1 GiB is available: lower --max (-e)");
  // Sizes up to 1 PiB times any rank count do not wrap around into a small need.
  EXPECT_NE(host_memory_problem({1ull << 50, 1ull << 50, 1ull << 50}, 1 << 30, UINT64_MAX / 2, "h"), "");
}

TEST(CommValidate, NonFiniteOrHugeSweepsAreErrors) {
  CommOptions o = two_rank_options();
  o.factor = std::numeric_limits<double>::infinity();
  EXPECT_THROW(validate_options(o, 2), UsageError);
  o.factor = 2;
  o.max_bytes = 16000000ull << 40;
  EXPECT_NE(error_of([&] { validate_options(o, 2); }).find("is too large"), std::string::npos);
}

CommReport one_series(double busbw) {
  CommReport report;
  ResultRow r{};
  r.op = Collective::kAllReduce;
  r.dtype = DType::kFP32;
  r.redop = RedOp::kSum;
  r.reduces = true;
  r.nranks = 2;
  r.ngroups = 1;
  r.size_bytes = 1024;
  r.out_of_place.measured = true;
  r.out_of_place.busbw = busbw;
  report.rows.push_back(r);
  return report;
}

TEST(CommGate, NaNNeverPassesSilently) {
  EXPECT_TRUE(busbw_gate_failures(one_series(5), 0).empty()) << "0 turns the gate off";
  EXPECT_TRUE(busbw_gate_failures(one_series(5), 4).empty());
  EXPECT_EQ(busbw_gate_failures(one_series(5), 6).size(), 1u);
  EXPECT_EQ(busbw_gate_failures(one_series(5), std::nan("")).size(), 1u);
  EXPECT_EQ(busbw_gate_failures(one_series(std::nan("")), 1).size(), 1u);
}

class CommOutputPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("keel_comm_outputs_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(CommOutputPaths, WritablePathsPassAndExistingFilesAreKept) {
  { std::ofstream(at("old.json")) << "previous results"; }
  CommOptions o;
  o.json_path = at("old.json");
  o.csv_path = at("new.csv");
  o.plot_path = at("p.png");
  EXPECT_NO_THROW(check_output_paths(o));
  std::stringstream kept;
  kept << std::ifstream(at("old.json")).rdbuf();
  EXPECT_EQ(kept.str(), "previous results");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1) << "no probe left behind";
}

TEST_F(CommOutputPaths, UnwritablePathsAreErrorsBeforeTheSweep) {
  CommOptions o;
  o.json_path = at("missing/r.json");
  EXPECT_NE(error_of([&] { check_output_paths(o); }).find("does not exist"), std::string::npos);
  o.json_path = dir_.string();
  EXPECT_NE(error_of([&] { check_output_paths(o); }).find("is a directory"), std::string::npos);
  o.json_path.clear();
  o.csv_path = "/proc/keel_no_such_file.csv";
  EXPECT_NE(error_of([&] { check_output_paths(o); }).find("--csv '/proc/keel_no_such_file.csv' cannot be written"),
            std::string::npos);
  o.csv_path.clear();
  o.plot_path = dir_.string();  // once wrote <dir>_all_reduce_... beside it and exited 0
  EXPECT_NE(error_of([&] { check_output_paths(o); }).find("--plot '" + dir_.string() + "' is a directory"),
            std::string::npos);
}

TEST_F(CommOutputPaths, TwoFlagsNamingOneFileAreAnError) {
  CommOptions o;
  o.json_path = at("a.json");
  o.csv_path = (dir_ / "." / "a.json").string();
  EXPECT_NE(error_of([&] { check_output_paths(o); }).find("--json and --csv both name"), std::string::npos);
  o.csv_path = at("a.csv");
  o.plot_path = at("a.csv");
  EXPECT_NE(error_of([&] { check_output_paths(o); }).find("--csv and --plot both name"), std::string::npos);
}

}  // namespace
}  // namespace keel::bench

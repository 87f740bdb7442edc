// The checkpoint library under MPI (2, 3 and 4 ranks): a real multi-rank save (async, two
// saves overlapping the next step's work, commit gathered at rank 0), then loads into layouts
// of 1, 2, 3 and 8 ranks (virtual ranks spread over the real ones), bit for bit, with read
// amplification 1; a full disk on one rank; ranks that disagree about a tensor.
#include <gtest/gtest.h>
#include <mpi.h>

#include "../mpi_test_util.h"
#include <unistd.h>

#include <filesystem>

#include "ckpt/comm.h"
#include "ckpt/demo.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "ckpt/writer.h"
#include "common/error.h"
#include "../error_message.h"

namespace fs = std::filesystem;
namespace mesh = keel::mesh;
using namespace keel::ckpt;

namespace {

using keel::test::world_rank;
using keel::test::world_size;

// A directory every rank sees (rank 0 picks the name).
std::string shared_root(const std::string& name) {
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  std::string path;
  if (comm->rank() == 0) {
    path = (fs::temp_directory_path() / fmt::format("keel_ckpt_mpi_{}_{}_{}", name, comm->size(), ::getpid())).string();
    fs::remove_all(path);
    fs::create_directories(path);
  }
  return comm->bcast(path);
}

const char* save_layout(int world) {
  switch (world) {
    case 4: return "dp=2,tp=2,zero=1";
    case 3: return "ep=3";  // dp fills the world: dp=3,ep=3
    case 2: return "pp=2";
    default: return "dp=1";
  }
}

const DemoConfig kCfg = parse_demo_config("layers=3,hidden=32,vocab=257,experts=6,ffn=24");

void save_steps(Saver& saver, const mesh::Shape& mesh, std::initializer_list<std::int64_t> steps) {
  for (std::int64_t step : steps) {
    DemoShards state = demo_state(kCfg, mesh, world_rank(), step);  // "the training step"
    saver.save(step, state.shards, {{"config", kCfg.to_json()}}, demo_rank_state(world_rank(), step), mesh.str());
  }
}

std::string error_of(const std::function<void()>& f) { return keel::test::error_message(f, "(no error)"); }

}  // namespace

TEST(CkptMpi, SaveHereLoadAt1238BitIdentical) {
  const std::string root = shared_root("reshard");
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  const mesh::Shape saved = parse_mesh(save_layout(comm->size()), comm->size());
  {
    Saver saver(*comm, root);
    save_steps(saver, saved, {10, 20});
    const auto st = saver.wait();
    ASSERT_TRUE(st);
    EXPECT_EQ(st->step, 20);
    EXPECT_GT(st->bytes, 0u);
  }
  EXPECT_EQ(latest_dir(root), (fs::path(root) / step_dir_name(20)).string());
  const Reader reader(root);
  EXPECT_EQ(reader.metadata().world, comm->size());
  EXPECT_EQ(reader.metadata().rank_states.size(), static_cast<std::size_t>(comm->size()));
  for (const char* layout : {"dp=1", "tp=2", "dp=3,ep=3,zero=1", "dp=3,zero=1", "pp=2,dp=2,ep=2,tp=2", "dp=8,zero=1",
                             "dp=2,cp=2,ep=4,zero=1"}) {
    const mesh::Shape target = parse_mesh(layout);
    double local[3] = {0, 0, 0}, sum[3];
    for (int v = comm->rank(); v < target.world(); v += comm->size()) {
      DemoTarget t = demo_target(kCfg, target, v);
      const LoadStats st = reader.load(t.requests);
      local[0] += static_cast<double>(st.bytes_needed);
      local[1] += static_cast<double>(st.bytes_read);
      std::string first;
      local[2] += static_cast<double>(demo_verify(t, 20, &first));
      EXPECT_EQ(first, "") << layout << " virtual rank " << v;
    }
    MPI_Allreduce(local, sum, 3, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    EXPECT_EQ(sum[2], 0) << layout;
    EXPECT_EQ(sum[0], sum[1]) << layout << ": read amplification " << sum[1] / sum[0];
  }
  // The earlier step is still there and loads too.
  const Reader older((fs::path(root) / step_dir_name(10)).string());
  DemoTarget t = demo_target(kCfg, parse_mesh("tp=3"), comm->rank() % 3);
  older.load(t.requests);
  EXPECT_EQ(demo_verify(t, 10, nullptr), 0);
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm->rank() == 0) fs::remove_all(root);
}

TEST(CkptMpi, FullDiskOnOneRankFailsEveryRankAndKeepsPrevious) {
  const std::string root = shared_root("enospc");
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  const mesh::Shape mesh = parse_mesh(save_layout(comm->size()), comm->size());
  {
    Saver saver(*comm, root);
    save_steps(saver, mesh, {1});
    saver.wait();
  }
  SaveOptions bad;
  bad.fail_with_enospc = comm->rank() == 1;
  Saver saver(*comm, root, bad);
  save_steps(saver, mesh, {2});
  const std::string err = error_of([&] { saver.wait(); });
  EXPECT_NE(err.find("save of step 2 failed on 1 rank(s)"), std::string::npos) << err;
  EXPECT_NE(err.find("rank 1: cannot write"), std::string::npos) << err;
  EXPECT_NE(err.find("No space left on device"), std::string::npos) << err;
  EXPECT_EQ(latest_dir(root), (fs::path(root) / step_dir_name(1)).string());
  const Reader reader(root);
  DemoTarget t = demo_target(kCfg, parse_mesh("dp=1"), 0);
  reader.load(t.requests);
  EXPECT_EQ(demo_verify(t, 1, nullptr), 0);
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm->rank() == 0) fs::remove_all(root);
}

TEST(CkptMpi, RanksDisagreeingOnATensorAreRejected) {
  const std::string root = shared_root("disagree");
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  std::vector<float> data(8, 1.f);
  mesh::Placement p;
  p.dims = {{}};
  const std::int64_t n = comm->rank() == 1 ? 9 : 8;  // rank 1 has another shape
  std::vector<SaveShard> shards = {{"w", ElemType::kF32, {n}, p, Box{{0}, {comm->rank() == 0 ? 8 : 0}}, data.data(),
                                    comm->rank() == 0}};
  Saver saver(*comm, root);
  saver.save(1, shards, {}, {}, "");
  const std::string err = error_of([&] { saver.wait(); });
  EXPECT_NE(err.find("tensor 'w': rank 1 saves f32 [9], rank 0 saves f32 [8]"), std::string::npos) << err;
  EXPECT_EQ(latest_dir(root), "");
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm->rank() == 0) fs::remove_all(root);
}

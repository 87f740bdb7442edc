// The checkpoint library in one process: checksum, geometry and the interval index against
// brute force, layouts (uneven and empty shards, one writer per distinct shard), metadata
// versioning, save -> load across layouts bit for bit, and every fault the issue lists.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <tuple>

#include "ckpt/checksum.h"
#include "ckpt/comm.h"
#include "ckpt/demo.h"
#include "ckpt/geometry.h"
#include "ckpt/layout.h"
#include "ckpt/metadata.h"
#include "ckpt/reader.h"
#include "ckpt/safetensors.h"
#include "ckpt/store.h"
#include "ckpt/tools.h"
#include "ckpt/writer.h"
#include "common/error.h"
#include "common/fileio.h"
#include "../error_message.h"

namespace fs = std::filesystem;
namespace mesh = keel::mesh;
using namespace keel::ckpt;
using keel::mesh::Axis;

namespace {

std::string temp_root(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / fmt::format("keel_ckpt_{}_{}", name, ::getpid());
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// Saves the demo state of every rank of `mesh` from this one process (as the offline tools
// do): the shards each virtual rank writes, committed as one checkpoint.
SaveStats save_virtual(const std::string& root, const DemoConfig& cfg, const mesh::Shape& mesh, std::int64_t step,
                       SaveOptions opt = {}) {
  std::vector<DemoShards> states;
  std::vector<SaveShard> shards;
  for (int r = 0; r < mesh.world(); ++r) {
    states.push_back(demo_state(cfg, mesh, r, step));
  }
  for (auto& s : states)
    for (auto& sh : s.shards)
      if (sh.write) shards.push_back(sh);
  auto comm = make_self_comm();
  Saver saver(*comm, root, opt);
  saver.save(step, shards, {{"config", cfg.to_json()}}, demo_rank_state(0, step), mesh.str());
  return *saver.wait();
}

// Loads every rank of `mesh` and returns the number of wrong elements; amplification out.
std::int64_t load_all(const std::string& path, const DemoConfig& cfg, const mesh::Shape& mesh, std::int64_t step,
                      double* amplification = nullptr) {
  const Reader reader(path);
  std::int64_t wrong = 0;
  std::uint64_t needed = 0, read = 0;
  for (int r = 0; r < mesh.world(); ++r) {
    DemoTarget t = demo_target(cfg, mesh, r);
    const LoadStats st = reader.load(t.requests);
    needed += st.bytes_needed;
    read += st.bytes_read;
    wrong += demo_verify(t, step, nullptr);
  }
  if (amplification) *amplification = needed ? double(read) / needed : 1.0;
  return wrong;
}

std::string error_of(const std::function<void()>& f) { return keel::test::error_message(f, "(no error)"); }

Box random_box(std::mt19937& g, const Shape& shape) {
  Box b;
  for (auto n : shape) {
    std::uniform_int_distribution<std::int64_t> d(0, n);
    std::int64_t a = d(g), c = d(g);
    if (a > c) std::swap(a, c);
    b.offsets.push_back(a);
    b.lengths.push_back(c - a);
  }
  return b;
}

const DemoConfig kCfg = parse_demo_config("layers=2,hidden=24,vocab=101,experts=5,ffn=12");

// Rewrites a committed checkpoint's metadata.json through its JSON (a damaged or hand-edited file).
void edit_metadata(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = (fs::path(dir) / kMetadataFile).string();
  auto j = nlohmann::json::parse(keel::read_file(path));
  edit(j);
  keel::write_file_atomically(path, j.dump(1));
}

// A safetensors file with this header (written as given, no checks) and `data` bytes of data.
void write_raw_safetensors(const std::string& path, const nlohmann::json& header, std::size_t data) {
  const std::string text = header.dump();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  bytes += text + std::string(data, '\1');
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// verify --all of `path`, its report discarded: the number of problems.
int verify_quietly(const std::string& path) {
  std::FILE* out = std::tmpfile();
  const int problems = verify(path, true, out);
  std::fclose(out);
  return problems;
}

// The names of every entry of a directory, sorted (to show a tool left it untouched).
std::vector<std::string> entries_of(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) out.push_back(fs::relative(e.path(), dir).string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(CkptChecksum, KnownVectorAndIncremental) {
  EXPECT_EQ(crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c(0, "", 0), 0u);
  std::vector<char> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 + 7);
  const std::uint32_t whole = crc32c(0, data.data(), data.size());
  EXPECT_EQ(crc32c(crc32c(0, data.data(), 333), data.data() + 333, 667), whole);
}

// The CPU instruction's sums (where this machine has it) equal the table's, on fresh random
// bytes at every alignment and length, whole and extended piecewise.
TEST(CkptChecksum, InstructionMatchesTable) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<unsigned char> data(70000);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  EXPECT_EQ(crc32c_table(0, "123456789", 9), 0xE3069283u);
  for (int i = 0; i < 400; ++i) {
    const std::size_t start = rng() % 64, n = i < 100 ? static_cast<std::size_t>(i) : rng() % (data.size() - 64);
    const std::uint32_t seed = i % 3 == 0 ? 0u : static_cast<std::uint32_t>(rng());
    const std::uint32_t want = crc32c_table(seed, data.data() + start, n);
    ASSERT_EQ(crc32c(seed, data.data() + start, n), want) << "start " << start << " length " << n;
    const std::size_t cut = n == 0 ? 0 : rng() % n;
    ASSERT_EQ(crc32c(crc32c(seed, data.data() + start, cut), data.data() + start + cut, n - cut), want);
  }
  if (!crc32c_hardware()) GTEST_SKIP() << "this CPU has no crc32 instruction: the table alone was checked";
}

TEST(CkptGeometry, RunsMatchElementwiseCopy) {
  std::mt19937 g(7);
  for (int iter = 0; iter < 300; ++iter) {
    const Shape shape = {1 + static_cast<std::int64_t>(g() % 5), 1 + static_cast<std::int64_t>(g() % 6),
                         1 + static_cast<std::int64_t>(g() % 4)};
    const Box a = random_box(g, shape), b = random_box(g, shape);
    const auto part = intersect(a, b);
    // Brute force: for each element of the intersection, its positions in a and b.
    std::vector<std::pair<std::int64_t, std::int64_t>> want, got;
    if (part)
      for (std::int64_t i = 0; i < part->lengths[0]; ++i)
        for (std::int64_t j = 0; j < part->lengths[1]; ++j)
          for (std::int64_t k = 0; k < part->lengths[2]; ++k) {
            const std::int64_t x = part->offsets[0] + i, y = part->offsets[1] + j, z = part->offsets[2] + k;
            want.push_back({((x - a.offsets[0]) * a.lengths[1] + (y - a.offsets[1])) * a.lengths[2] + (z - a.offsets[2]),
                            ((x - b.offsets[0]) * b.lengths[1] + (y - b.offsets[1])) * b.lengths[2] + (z - b.offsets[2])});
          }
    if (part)
      for_each_run(*part, a, b, [&](const keel::ckpt::Run& r) {
        for (std::int64_t i = 0; i < r.count; ++i) got.push_back({r.src + i, r.dst + i});
      });
    ASSERT_EQ(got, want) << box_str(a) << " " << box_str(b);
  }
}

TEST(CkptGeometry, IndexMatchesBruteForce) {
  std::mt19937 g(11);
  const Shape shape = {50, 40};
  std::vector<Box> boxes;
  for (int i = 0; i < 200; ++i) boxes.push_back(random_box(g, shape));
  const ShardIndex index(boxes);
  for (int q = 0; q < 500; ++q) {
    const Box query = random_box(g, shape);
    std::vector<std::size_t> want;
    for (std::size_t i = 0; i < boxes.size(); ++i)
      if (intersect(boxes[i], query)) want.push_back(i);
    ASSERT_EQ(index.query(query), want) << box_str(query);
  }
}

// Every flat range of a few shapes: the boxes are few, follow each other in flat order, and
// together are exactly the range.
TEST(CkptGeometry, FlatRangeBoxes) {
  for (const Shape& shape : {Shape{7}, Shape{3, 5}, Shape{2, 3, 4}, Shape{2, 1, 3, 2}, Shape{4, 0, 3}}) {
    const std::int64_t n = numel(shape);
    for (std::int64_t b = 0; b <= n; ++b)
      for (std::int64_t e = b; e <= n; ++e) {
        const auto boxes = flat_range_boxes(shape, b, e);
        EXPECT_LE(boxes.size(), 2 * shape.size() - 1);
        std::int64_t at = b;
        for (const auto& box : boxes) {
          ASSERT_EQ(box.ndim(), shape.size());
          EXPECT_GT(box.volume(), 0);
          // the box's elements in row-major order are the flat indices at, at + 1, ...
          std::int64_t k = 0;
          for_each_run(box, box, full_box(shape), [&](const keel::ckpt::Run& r) {
            EXPECT_EQ(r.dst, at + k) << "box not contiguous in flat order";
            k += r.count;
          });
          at += box.volume();
        }
        EXPECT_EQ(at, e) << "range [" << b << ", " << e << ")";
      }
  }
  EXPECT_THROW(flat_range_boxes(Shape{3, 5}, 4, 16), keel::Error);
}

TEST(CkptGeometry, Coverage) {
  const Shape s = {4, 4};
  EXPECT_EQ(coverage_problem(s, {Box{{0, 0}, {2, 4}}, Box{{2, 0}, {2, 4}}, Box{{4, 0}, {0, 4}}}), "");
  EXPECT_NE(coverage_problem(s, {Box{{0, 0}, {3, 4}}, Box{{2, 0}, {2, 4}}}).find("overlap"), std::string::npos);
  EXPECT_NE(coverage_problem(s, {Box{{0, 0}, {2, 4}}}).find("8 of 16 elements"), std::string::npos);
  EXPECT_NE(coverage_problem(s, {Box{{3, 0}, {2, 4}}}).find("outside"), std::string::npos);
  EXPECT_EQ(coverage_problem({}, {Box{}}), "");  // a 0-d tensor: one element
}

TEST(CkptLayout, ParseAndUnevenSplits) {
  EXPECT_EQ(parse_mesh("tp=2", 8).dp, 4);
  EXPECT_EQ(parse_mesh("pp=2,dp=2,ep=2,tp=2,zero=1").world(), 8);
  // ep is folded into dp*cp: a layout that leaves dp to the world keeps its ranks.
  EXPECT_EQ(parse_mesh("pp=2,ep=2,tp=2,zero=1", 8).dp, 2);
  EXPECT_EQ(parse_mesh("ep=3", 3).str(), "dp=3,ep=3");
  EXPECT_EQ(parse_mesh("dp=2,tp=2,zero=1").str(), "dp=2,tp=2,zero=1");
  EXPECT_EQ(parse_mesh("dp=4,ep=2,zero=1").world(), 4);
  EXPECT_NE(error_of([] { parse_mesh("tp=3", 4); }).find("layout 'tp=3': pp*cp*tsp*tp = 3 does not divide the 4 ranks"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh("dp=2,tp=2", 8); })
                .find("layout 'dp=2,tp=2' spans 4 ranks (pp*dp*cp*tsp*tp), but there are 8"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh("mp=2"); }).find("unknown axis 'mp'"), std::string::npos);
  // Without a world, ep alone spans one rank it cannot fold into; and the old four-axis
  // "dp=2,ep=3" (6 ranks) is now "dp=6,ep=3".
  EXPECT_NE(error_of([] { parse_mesh("ep=3"); }).find("layout 'ep=3': ep=3 does not divide dp*cp = 1"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh("dp=2,ep=3,tp=2"); }).find("ep=3 does not divide dp*cp = 2"), std::string::npos);
  EXPECT_EQ(parse_mesh("dp=6,ep=3,tp=2").world(), 12);
  // Checkpoints know ZeRO 0 and 1 (keel size models 2 and 3).
  EXPECT_NE(error_of([] { parse_mesh("dp=4,zero=2"); }).find("zero=2 has no checkpoint layout (checkpoints know zero 0 and 1"),
            std::string::npos);
  // 5 rows over 4 ranks: 2, 2, 1, 0 (an empty shard).
  mesh::Placement p;
  p.dims = {{Axis::kTensor}, {}};
  const mesh::Shape m = parse_mesh("tp=4");
  std::vector<std::int64_t> lens;
  for (int r = 0; r < 4; ++r) lens.push_back(rank_shard({5, 3}, p, m, r, 0).box.lengths[0]);
  EXPECT_EQ(lens, (std::vector<std::int64_t>{2, 2, 1, 0}));
  EXPECT_FALSE(rank_shard({5, 3}, p, m, 3, 0).writer);  // empty shards are not written
}

// The old four-axis mesh (world = pp*dp*ep*tp, rank = ((p*dp + d)*ep + e)*tp + t): a layout that
// left dp to the world keeps its rank count, and every rank its coordinates, with the expert
// coordinate the old e and the expert-data coordinate the old d.
TEST(CkptLayout, OldLayoutsWithoutDpKeepTheirRanksAndCoordinates) {
  const std::vector<std::pair<std::string, int>> old = {
      {"ep=3", 3}, {"pp=2,ep=2,tp=2", 8}, {"ep=2,tp=2", 8}, {"pp=2,ep=3,zero=1", 12}, {"ep=4", 8}};
  for (const auto& [text, world] : old) {
    const mesh::Shape m = parse_mesh(text, world);
    ASSERT_EQ(m.world(), world) << text;
    const int dp_old = world / (m.pp * m.ep * m.tp);
    EXPECT_EQ(m.dp, dp_old * m.ep) << text;
    for (int r = 0; r < world; ++r) {
      const int t = r % m.tp, e = (r / m.tp) % m.ep, d = (r / (m.tp * m.ep)) % dp_old, pp = r / (m.tp * m.ep * dp_old);
      const mesh::Coord c = m.coord(r);
      EXPECT_EQ(c.pp, pp) << text << " rank " << r;
      EXPECT_EQ(c.ep, e) << text << " rank " << r;
      EXPECT_EQ(c.edp, d) << text << " rank " << r;
      EXPECT_EQ(c.tp, t) << text << " rank " << r;
    }
  }
}

// For many meshes: writers' boxes cover each demo tensor exactly once, replicated tensors
// are written by exactly one rank, and the writing is spread over ranks.
TEST(CkptLayout, OneWriterPerDistinctShard) {
  const auto tensors = demo_tensors(kCfg);
  for (const char* layout : {"dp=1", "dp=4,zero=1", "tp=3", "dp=4,ep=4", "pp=2,dp=2", "pp=3,dp=2,ep=2,tp=2,zero=1",
                             "dp=6,ep=3,tp=2"}) {
    const mesh::Shape mesh = parse_mesh(layout);
    std::vector<std::uint64_t> per_rank(mesh.world());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      std::vector<Box> boxes;
      for (int r = 0; r < mesh.world(); ++r) {
        const RankShard s = rank_shard(tensors[i].shape, tensors[i].placement, mesh, r, i);
        if (s.writer) boxes.push_back(s.box), per_rank[r] += s.box.volume();
      }
      EXPECT_EQ(coverage_problem(tensors[i].shape, boxes), "") << layout << " " << tensors[i].name;
    }
    for (int r = 0; r < mesh.world(); ++r) EXPECT_GT(per_rank[r], 0u) << layout << " rank " << r << " writes nothing";
  }
}

// Expert parallelism folded into dp*cp, as keel train runs it. For meshes with ep (with and
// without ZeRO, with tp, pp, cp and tsp; experts even and uneven over ep): the writers of every
// tensor cover it exactly once; a rank holds the experts of its expert coordinate, the same block
// as every rank of that coordinate (on its stage and tensor slice); and under ZeRO an expert
// state's parts run over the expert-data ranks, inside the rank's experts when these split evenly.
TEST(CkptLayout, FoldedExpertParallelismWritesEveryElementOnce) {
  for (const char* model : {"layers=2,hidden=24,vocab=101,experts=5,ffn=12", "layers=3,hidden=16,vocab=64,experts=8,ffn=8"}) {
    const DemoConfig cfg = parse_demo_config(model);
    const auto tensors = demo_tensors(cfg);
    for (const char* layout : {"dp=4,ep=2", "dp=4,ep=2,zero=1", "dp=4,ep=4,zero=1", "dp=8,ep=4,zero=1", "dp=6,ep=3,tp=2",
                               "dp=6,ep=3,tp=2,zero=1", "pp=2,dp=4,ep=2,tp=2,zero=1", "pp=3,dp=2,ep=2,tp=2",
                               "dp=2,cp=2,ep=4,zero=1", "dp=3,cp=2,ep=2,zero=1", "dp=2,cp=2,ep=2,tsp=2,tp=2,zero=1"}) {
      SCOPED_TRACE(std::string(model) + " on " + layout);
      const mesh::Shape mesh = parse_mesh(layout);
      std::vector<std::uint64_t> per_rank(mesh.world());
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        const DemoTensor& t = tensors[i];
        const bool expert = t.placement.splits(Axis::kExpert);
        const std::int64_t E = cfg.experts, per = (E + mesh.ep - 1) / mesh.ep;
        std::vector<Box> boxes;
        std::map<std::tuple<int, int, int, int>, Box> block;  // (pp, ep, tsp, tp) -> the expert block held
        for (int r = 0; r < mesh.world(); ++r) {
          const RankShard s = rank_shard(t.shape, t.placement, mesh, r, i);
          if (s.writer) boxes.push_back(s.box), per_rank[r] += s.box.volume();
          if (!expert || !s.held) continue;
          const mesh::Coord c = mesh.coord(r);
          if (!t.placement.zero || mesh.zero == 0) {
            EXPECT_EQ(s.box.offsets[0], std::min(E, c.ep * per)) << t.name << " rank " << r;
            EXPECT_EQ(s.box.lengths[0], std::min(E, c.ep * per + per) - std::min(E, c.ep * per)) << t.name;
            const auto [it, fresh] = block.try_emplace({c.pp, c.ep, c.tsp, c.tp}, s.box);
            EXPECT_EQ(it->second, s.box) << t.name << " rank " << r << ": another block than its expert group's";
          } else if (E % (mesh.ep * mesh.expert_data()) == 0) {
            // ZeRO over the expert-data ranks, inside the rank's own experts (parts are cut from
            // the product of the degrees: nested in the expert blocks when the experts split evenly).
            EXPECT_GE(s.box.offsets[0], c.ep * per) << t.name << " rank " << r;
            EXPECT_LE(s.box.offsets[0] + s.box.lengths[0], c.ep * per + per) << t.name << " rank " << r;
          }
        }
        EXPECT_EQ(coverage_problem(t.shape, boxes), "") << t.name;
      }
      // ZeRO spreads the writes over every rank (without it a stage of few tensors, as the last
      // of pp=3 here, has fewer distinct shards than ranks).
      if (mesh.zero == 1)
        for (int r = 0; r < mesh.world(); ++r) EXPECT_GT(per_rank[r], 0u) << "rank " << r << " writes nothing";
    }
  }
}

// ZeRO cuts an optimizer state over the data ranks that hold the same block: dp then cp (the
// dp*cp block, j = d*cp + c) for a tensor not split over ep, the expert-data coordinate for one
// that is.
TEST(CkptLayout, ZeroSplitsOverTheDataBlockOrTheExpertDataRanks) {
  mesh::Placement dense = mesh::Placement::replicated(1);
  dense.zero = true;
  mesh::Placement experts = mesh::Placement::split(2, 0, Axis::kExpert);
  experts.zero = true;
  const mesh::Shape m = parse_mesh("dp=2,cp=2,ep=2,tp=2,zero=1");  // 8 ranks, j = d*2 + c
  for (int r = 0; r < m.world(); ++r) {
    const mesh::Coord c = m.coord(r);
    const int j = c.dp * m.cp + c.cp;
    EXPECT_EQ(rank_shard({8}, dense, m, r, 0).box, (Box{{2 * j}, {2}})) << "rank " << r;
    // Experts [4, 3] over ep=2 (2 each), each block over the 2 expert-data ranks: row ep*2 + edp.
    EXPECT_EQ(rank_shard({4, 3}, experts, m, r, 0).box, (Box{{c.ep * 2 + c.edp, 0}, {1, 3}})) << "rank " << r;
  }
  // zero=0: no ZeRO cut; the states follow their parameters.
  const mesh::Shape plain = parse_mesh("dp=2,cp=2,ep=2,tp=2");
  EXPECT_EQ(rank_shard({8}, dense, plain, 5, 0).box, full_box({8}));
  EXPECT_EQ(rank_shard({4, 3}, experts, plain, 5, 0).box, (Box{{plain.coord(5).ep * 2, 0}, {2, 3}}));
}

// A tensor split over ep cannot be split over dp or cp too (its expert coordinate is made of
// them); nor one pipeline stage's tensor over pp; and checkpoints know zero 0 and 1 only. Such
// a placement is refused where it would be placed (rank_shard, a save's commit, reshard,
// naming the tensor); stored, as the four-axis mesh allowed, it still reads and loads.
TEST(CkptLayout, PlacementsTheFoldedMeshCannotHoldAreErrors) {
  auto check = [](const std::string& text) {
    return error_of([&] { check_placement(placement_from_json(nlohmann::json::parse(text))); });
  };
  EXPECT_NE(check(R"({"dims": [["ep"], ["dp"]]})").find("placement splits over ep and dp: expert parallelism is folded into dp*cp"),
            std::string::npos);
  EXPECT_NE(check(R"({"dims": [["cp", "ep"]]})").find("placement splits over ep and cp"), std::string::npos);
  EXPECT_NE(check(R"({"dims": [["pp"]], "pp_unit": 0, "pp_units": 2})").find("splits over pp but lives on one pipeline stage"),
            std::string::npos);
  EXPECT_EQ(check(R"({"dims": [["ep"], ["tp"], ["tsp"]], "zero": true})"), "(no error)");
  EXPECT_EQ(error_of([] { placement_from_json(nlohmann::json::parse(R"({"dims": [["ep"], ["dp"]]})")); }), "(no error)");
  mesh::Placement both = mesh::Placement::split(2, 0, Axis::kExpert);
  both.dims[1].push_back(Axis::kData);
  const mesh::Shape m = parse_mesh("dp=4,ep=2");
  EXPECT_NE(error_of([&] { rank_shard({4, 4}, both, m, 0, 0); }).find("placement splits over ep and dp"), std::string::npos);
  mesh::Shape zero2 = m;
  zero2.zero = 2;
  EXPECT_NE(error_of([&] { rank_shard({4}, mesh::Placement::replicated(1), zero2, 0, 0); }).find("checkpoints know zero 0 and 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { rank_shard({4}, mesh::Placement::replicated(1), m, 4, 0); }).find("rank 4 is outside layout dp=4,ep=2"),
            std::string::npos);

  const std::string root = temp_root("folded_placement");
  // A save declaring one is refused at commit, naming the tensor; nothing is committed.
  {
    auto comm = make_self_comm();
    Saver saver(*comm, root + "/save");
    std::vector<float> w(16, 1.f);
    saver.save(1, {{"w", ElemType::kF32, {4, 4}, both, full_box({4, 4}), w.data(), true}}, {}, {}, "dp=4,ep=2");
    EXPECT_NE(error_of([&] { saver.wait(); }).find("tensor 'w' (rank 0): placement splits over ep and dp"), std::string::npos);
    EXPECT_EQ(latest_dir(root + "/save"), "");
  }
  // A stored one (as the four-axis mesh could write) loads; reshard refuses it, naming the tensor.
  save_virtual(root + "/old", kCfg, parse_mesh("tp=2"), 1);
  edit_metadata(resolve_checkpoint(root + "/old"), [](nlohmann::json& j) {
    for (auto& t : j["tensors"])
      if (t["name"] == "embed.weight") t["placement"]["dims"] = nlohmann::json::parse(R"([["ep"], ["dp"]])");
  });
  EXPECT_EQ(load_all(root + "/old", kCfg, parse_mesh("dp=3,ep=3"), 1), 0);
  EXPECT_NE(error_of([&] { reshard(root + "/old", root + "/resharded", "dp=2,ep=2", 1); })
                .find("tensor 'embed.weight': placement splits over ep and dp"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(root + "/resharded"));
  fs::remove_all(root);
}

// Placements in checkpoint metadata keep their format: axes by short name, "zero" only when
// set, the pipeline unit only when the tensor lives on one stage. What earlier keel wrote reads
// as it was; the axes cp and tsp are written the same way.
TEST(CkptLayout, PlacementJsonKeepsItsFormat) {
  const auto old = nlohmann::json::parse(R"({"dims": [["ep"], ["tp"], []], "zero": true, "pp_unit": 1, "pp_units": 4})");
  const mesh::Placement p = placement_from_json(old);
  EXPECT_EQ(p.dims, (std::vector<std::vector<Axis>>{{Axis::kExpert}, {Axis::kTensor}, {}}));
  EXPECT_TRUE(p.zero);
  EXPECT_EQ(p.pp_unit, 1);
  EXPECT_EQ(p.pp_units, 4);
  EXPECT_EQ(placement_to_json(p), old);
  const auto axes = nlohmann::json::parse(R"({"dims": [["cp", "tsp"], ["pp", "dp"]]})");
  EXPECT_EQ(placement_to_json(placement_from_json(axes)), axes);
  EXPECT_EQ(placement_to_json(mesh::Placement::replicated(2)), nlohmann::json::parse(R"({"dims": [[], []]})"));
  EXPECT_EQ(placement_to_json(mesh::Placement::replicated(0)), nlohmann::json::parse(R"({"dims": []})"));
}

TEST(CkptMetadata, RoundTripAndVersioning) {
  Metadata m;
  m.step = 7;
  m.layout = "pp=1,dp=1,ep=1,tp=1,zero=0";
  m.files["data_r00000_b0.bin"] = 16;
  TensorMeta t;
  t.name = "w";
  t.type = ElemType::kBF16;
  t.shape = {2, 4};
  t.placement.dims = {{}, {}};
  t.shards.push_back({full_box(t.shape), "data_r00000_b0.bin", 0, 16, 0x1234});
  m.tensors.push_back(t);
  const std::string text = metadata_to_json(m);
  const Metadata back = parse_metadata(text, "m.json");
  ASSERT_EQ(back.tensors.size(), 1u);
  EXPECT_EQ(back.tensors[0].shards[0].crc, 0x1234u);
  EXPECT_EQ(back.tensors[0].shape, t.shape);
  auto j = nlohmann::json::parse(text);
  j["version"] = 2;
  EXPECT_NE(error_of([&] { parse_metadata(j.dump(), "m.json"); })
                .find("m.json: metadata format version 2, but this keel reads version 1 only"),
            std::string::npos);
  j["format"] = "torch.dcp";
  EXPECT_NE(error_of([&] { parse_metadata(j.dump(), "m.json"); }).find("not a keel checkpoint"), std::string::npos);
  EXPECT_NE(error_of([&] { parse_metadata("{\"format\": \"keel.ckpt\", ", "m.json"); }).find("not valid JSON"),
            std::string::npos);
}

// Save in one layout, load in others (world 1, 2, 3, 8; uneven and empty shards, ZeRO-1,
// pipeline stages, ep folded into dp and cp), bit-identical with read amplification 1.
TEST(CkptSaveLoad, AnyLayoutToAnyOther) {
  const std::string root = temp_root("any");
  const mesh::Shape saved = parse_mesh("dp=2,tp=2,zero=1");
  save_virtual(root, kCfg, saved, 5);
  for (const char* layout : {"dp=1", "tp=2", "dp=3,ep=3", "dp=3,zero=1", "pp=2,dp=2,ep=2,tp=2", "dp=8,zero=1", "pp=4,tp=2",
                             "dp=4,ep=2,zero=1", "dp=2,cp=2,ep=4,zero=1", "dp=2,cp=2,ep=2,tsp=2,zero=1"}) {
    double amp = 0;
    EXPECT_EQ(load_all(root, kCfg, parse_mesh(layout), 5, &amp), 0) << layout;
    EXPECT_DOUBLE_EQ(amp, 1.0) << layout;
  }
  // Saved with experts over ep (folded into dp, ZeRO over the expert-data ranks), loaded back.
  const std::string ep_root = temp_root("any_ep");
  save_virtual(ep_root, kCfg, parse_mesh("pp=2,dp=4,ep=2,tp=2,zero=1"), 6);
  for (const char* layout : {"dp=1", "dp=3,ep=3,zero=1", "dp=2,tp=2,zero=1", "dp=2,cp=2,ep=4,zero=1"}) {
    double amp = 0;
    EXPECT_EQ(load_all(ep_root, kCfg, parse_mesh(layout), 6, &amp), 0) << layout;
    EXPECT_DOUBLE_EQ(amp, 1.0) << layout;
  }
  EXPECT_EQ(read_metadata(resolve_checkpoint(ep_root)).world, 16);
  fs::remove_all(ep_root);
  fs::remove_all(root);
}

// Metadata "world" is the saved layout's rank count (offline tools save other worlds than their
// own one process): keel train's "dp=4,ep=2,zero=1" on 4 ranks is 4 ranks, ep folded into dp
// (the old four-axis mesh read it as 8); no layout is the saving world.
TEST(CkptSaveLoad, MetadataWorldIsTheLayoutsRankCount) {
  const std::string root = temp_root("world");
  auto comm = make_self_comm();
  Saver saver(*comm, root);
  std::vector<float> x(6, 1.f);
  mesh::Placement p = mesh::Placement::replicated(1);
  p.zero = true;
  struct Case {
    std::int64_t step;
    const char* layout;
    int world;
  };
  for (const Case& c : {Case{1, "dp=4,ep=2,zero=1", 4}, Case{2, "dp=2,ep=2,zero=1", 2}, Case{3, "dp=8,ep=4,zero=1", 8},
                        Case{4, "pp=2,dp=3,ep=3", 6}, Case{5, "", 1}}) {
    saver.save(c.step, {{"x", ElemType::kF32, {6}, p, full_box({6}), x.data(), true}}, {}, {}, c.layout);
    ASSERT_TRUE(saver.wait());
    const Metadata m = read_metadata(resolve_checkpoint(root));
    EXPECT_EQ(m.step, c.step);
    EXPECT_EQ(m.world, c.world) << c.layout;
    EXPECT_EQ(m.layout, c.layout);
  }
  fs::remove_all(root);
}

TEST(CkptSaveLoad, AsyncOneInFlightAndRetention) {
  const std::string root = temp_root("retention");
  const mesh::Shape mesh = parse_mesh("tp=2");
  auto comm = make_self_comm();
  SaveOptions opt;
  opt.keep_last = 2;
  opt.keep_every = 5;
  Saver saver(*comm, root, opt);
  for (int step = 1; step <= 10; ++step) {
    std::vector<DemoShards> states;
    std::vector<SaveShard> shards;
    for (int r = 0; r < mesh.world(); ++r) states.push_back(demo_state(kCfg, mesh, r, step));
    for (auto& s : states)
      for (auto& sh : s.shards)
        if (sh.write) shards.push_back(sh);
    const double stall = saver.save(step, shards, {{"config", kCfg.to_json()}}, {}, mesh.str());
    EXPECT_GE(stall, 0);
    EXPECT_TRUE(saver.in_flight());
    // The previous save was completed (committed) before this one started.
    if (step > 1) EXPECT_TRUE(fs::exists(fs::path(root) / step_dir_name(step - 1) / kMetadataFile));
    states.clear();  // the caller's buffers may change at once: save() staged a copy
  }
  const auto st = saver.wait();
  ASSERT_TRUE(st);
  EXPECT_GT(st->bytes, 0u);
  std::vector<std::int64_t> kept;
  for (const auto& s : list_steps(root)) kept.push_back(s.step);
  EXPECT_EQ(kept, (std::vector<std::int64_t>{5, 9, 10}));
  EXPECT_EQ(load_all(root, kCfg, parse_mesh("dp=3"), 10), 0);
  EXPECT_EQ(load_all(fs::path(root) / step_dir_name(5), kCfg, parse_mesh("dp=1"), 5), 0);
  fs::remove_all(root);
}

// Write-behind (SaveOptions::flush_behind_bytes): the data goes to disk window by window while
// it is written; the files are the same bytes as without it, and load back exactly.
TEST(CkptSaveLoad, WriteBehindFlushesWhileWritingAndWritesTheSameBytes) {
  const DemoConfig cfg = parse_demo_config("layers=2,hidden=64,vocab=512,experts=4,ffn=128");
  const mesh::Shape mesh = parse_mesh("dp=2,zero=1");
  SaveOptions on, off;
  on.chunk_bytes = 4096;
  on.flush_behind_bytes = 16384;
  off.chunk_bytes = 4096;
  off.flush_behind_bytes = 0;
  const std::string a = temp_root("behind_on"), b = temp_root("behind_off");
  const SaveStats sa = save_virtual(a, cfg, mesh, 4, on);
  const SaveStats sb = save_virtual(b, cfg, mesh, 4, off);
  ASSERT_GT(sa.bytes, 8 * on.flush_behind_bytes);  // many windows
  EXPECT_EQ(sb.flushed_behind, 0u);
  // Flushed while writing: all but the last one or two windows of each file, unless this file
  // system refuses sync_file_range (then the final fsync does it all, as with the window off).
  const int fd = ::open((fs::path(a) / "probe").c_str(), O_WRONLY | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  const bool supported = ::sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) == 0;
  ::close(fd);
  fs::remove(fs::path(a) / "probe");
  if (supported) {
    EXPECT_GT(sa.flushed_behind, sa.bytes / 2);
    EXPECT_LE(sa.flushed_behind, sa.bytes);
  }
  EXPECT_EQ(load_all(a, cfg, parse_mesh("dp=3"), 4), 0);
  EXPECT_EQ(verify_quietly(a), 0);
  const std::string da = resolve_checkpoint(a), db = resolve_checkpoint(b);
  for (const auto& e : fs::directory_iterator(da)) {
    const std::string name = e.path().filename().string();
    if (name == kMetadataFile) continue;
    EXPECT_EQ(keel::read_file(e.path().string()), keel::read_file((fs::path(db) / name).string())) << name;
  }
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(CkptSaveLoad, ReservedStagingIsUsedAndRefusedWhileASaveIsInFlight) {
  const std::string root = temp_root("reserve");
  const mesh::Shape mesh = parse_mesh("tp=2");
  auto comm = make_self_comm();
  Saver saver(*comm, root);
  std::vector<DemoShards> states;
  std::vector<SaveShard> shards;
  for (int r = 0; r < mesh.world(); ++r) states.push_back(demo_state(kCfg, mesh, r, 7));
  for (auto& s : states)
    for (auto& sh : s.shards)
      if (sh.write) shards.push_back(sh);
  saver.reserve(shards);  // the buffers of exactly this save, before it
  saver.save(7, shards, {{"config", kCfg.to_json()}}, {}, mesh.str());
  EXPECT_NE(error_of([&] { saver.reserve(shards); }).find("reserve() while a save is in flight"), std::string::npos);
  ASSERT_TRUE(saver.wait());
  EXPECT_EQ(load_all(root, kCfg, parse_mesh("dp=2"), 7), 0);
  fs::remove_all(root);
}

TEST(CkptFaults, FullDiskLeavesPreviousCheckpoint) {
  const std::string root = temp_root("enospc");
  const mesh::Shape mesh = parse_mesh("tp=2");
  save_virtual(root, kCfg, mesh, 1);
  SaveOptions bad;
  bad.fail_with_enospc = true;
  const std::string err = error_of([&] { save_virtual(root, kCfg, mesh, 2, bad); });
  EXPECT_NE(err.find("save of step 2 failed"), std::string::npos) << err;
  EXPECT_NE(err.find("No space left on device"), std::string::npos) << err;
  EXPECT_NE(err.find("data_r00000_b"), std::string::npos) << err;  // names the file
  EXPECT_EQ(latest_dir(root), (fs::path(root) / step_dir_name(1)).string());
  EXPECT_FALSE(fs::exists(fs::path(root) / step_dir_name(2)));
  EXPECT_EQ(load_all(root, kCfg, parse_mesh("dp=1"), 1), 0);
  fs::remove_all(root);
}

TEST(CkptFaults, TornSaveIsIgnoredAndReported) {
  const std::string root = temp_root("torn");
  save_virtual(root, kCfg, parse_mesh("dp=1"), 1);
  // A save that died before its commit: data, no metadata.
  fs::create_directories(fs::path(root) / step_dir_name(2));
  std::ofstream(fs::path(root) / step_dir_name(2) / "data_r00000_b0.bin") << "partial";
  EXPECT_EQ(resolve_checkpoint(root), (fs::path(root) / step_dir_name(1)).string());
  EXPECT_NE(error_of([&] { Reader r((fs::path(root) / step_dir_name(2)).string()); }).find("incomplete checkpoint"),
            std::string::npos);
  std::FILE* out = std::tmpfile();
  EXPECT_EQ(verify(root, false, out), 0);
  std::rewind(out);
  char buf[4096] = {0};
  std::fread(buf, 1, sizeof(buf) - 1, out);
  std::fclose(out);
  EXPECT_NE(std::string(buf).find("step_00000002  INCOMPLETE"), std::string::npos) << buf;
  // The next save at that step replaces the torn directory.
  save_virtual(root, kCfg, parse_mesh("dp=1"), 2);
  EXPECT_EQ(load_all(root, kCfg, parse_mesh("tp=2"), 2), 0);
  fs::remove_all(root);
}

TEST(CkptFaults, CorruptedTruncatedMissingFiles) {
  const std::string root = temp_root("corrupt");
  const mesh::Shape mesh = parse_mesh("tp=2");
  save_virtual(root, kCfg, mesh, 3);
  const std::string dir = resolve_checkpoint(root);
  const Metadata m = read_metadata(dir);
  const TensorMeta* t = m.find("embed.weight");
  ASSERT_TRUE(t);
  const StoredShard& s = t->shards[0];
  const std::string file = (fs::path(dir) / s.file).string();
  std::string bytes = keel::read_file(file);
  const std::string good = bytes;
  bytes[s.offset + s.nbytes / 2] ^= 0x5a;
  std::ofstream(file, std::ios::binary).write(bytes.data(), bytes.size());
  // Loading in the saved layout reads the shard whole and checks its CRC.
  const std::string err = error_of([&] { load_all(root, kCfg, mesh, 3); });
  EXPECT_NE(err.find("tensor 'embed.weight': checksum mismatch"), std::string::npos) << err;
  // A resharded load with checksums verified sees it too; verify reports it.
  const std::string err2 = error_of([&] {
    const Reader r(root);
    DemoTarget tgt = demo_target(kCfg, parse_mesh("tp=3"), 0);
    LoadOptions lo;
    lo.verify_checksums = true;
    r.load(tgt.requests, lo);
  });
  EXPECT_NE(err2.find("checksum mismatch"), std::string::npos) << err2;
  const VerifyResult v = verify_checkpoint(dir);
  ASSERT_EQ(v.problems.size(), 1u);
  EXPECT_NE(v.problems[0].find("tensor 'embed.weight'"), std::string::npos);
  // Truncated.
  std::ofstream(file, std::ios::binary).write(good.data(), good.size() / 2);
  const std::string err3 = error_of([&] { load_all(root, kCfg, mesh, 3); });
  EXPECT_NE(err3.find("truncated"), std::string::npos) << err3;
  EXPECT_NE(err3.find(s.file), std::string::npos) << err3;
  // Missing.
  fs::remove(file);
  const std::string err4 = error_of([&] { load_all(root, kCfg, mesh, 3); });
  EXPECT_NE(err4.find("cannot open data file"), std::string::npos) << err4;
  EXPECT_FALSE(verify_checkpoint(dir).problems.empty());
  fs::remove_all(root);
}

TEST(CkptFaults, MismatchAndCoverageErrorsNameTheTensor) {
  const std::string root = temp_root("mismatch");
  save_virtual(root, kCfg, parse_mesh("dp=1"), 1);
  const Reader r(root);
  std::vector<char> buf(1 << 20);
  auto one = [&](LoadRequest q) { return error_of([&] { r.load({q}); }); };
  EXPECT_NE(one({"embed.weight", ElemType::kF32, {101, 24}, full_box({101, 24}), buf.data()})
                .find("tensor 'embed.weight': the checkpoint stores bf16, the target asks for f32"),
            std::string::npos);
  EXPECT_NE(one({"embed.weight", ElemType::kBF16, {102, 24}, full_box({102, 24}), buf.data()})
                .find("tensor 'embed.weight': the checkpoint's shape is [101, 24], the target's [102, 24]"),
            std::string::npos);
  EXPECT_NE(one({"no.such", ElemType::kBF16, {1}, full_box({1}), buf.data()}).find("tensor 'no.such' is not in"),
            std::string::npos);
  // A checkpoint that does not cover what the target asks for (a shard dropped from metadata).
  const std::string dir = resolve_checkpoint(root);
  Metadata m = read_metadata(dir);
  for (auto& t : m.tensors)
    if (t.name == "lm_head.weight") {
      t.shards[0].box.lengths[0] = 50;
      t.shards[0].nbytes = 50 * 24 * 2;
    }
  keel::write_file_atomically((fs::path(dir) / kMetadataFile).string(), metadata_to_json(m));
  const Reader r2(root);
  const std::string err = error_of([&] { r2.load({{"lm_head.weight", ElemType::kBF16, {101, 24}, full_box({101, 24}), buf.data()}}); });
  EXPECT_NE(err.find("tensor 'lm_head.weight': the checkpoint covers 1200 of the 2424 elements"), std::string::npos) << err;
  EXPECT_NE(verify_checkpoint(dir).problems.at(0).find("lm_head.weight"), std::string::npos);
  fs::remove_all(root);
}

TEST(CkptFaults, SaveThatDoesNotCoverIsNotCommitted) {
  const std::string root = temp_root("nocover");
  save_virtual(root, kCfg, parse_mesh("dp=1"), 1);
  std::vector<char> data(10 * 4);
  mesh::Placement p;
  p.dims = {{Axis::kTensor}};
  auto comm = make_self_comm();
  Saver saver(*comm, root);
  saver.save(2, {{"half", ElemType::kF32, {20}, p, Box{{0}, {10}}, data.data(), true}}, {}, {}, "");
  const std::string err = error_of([&] { saver.wait(); });
  EXPECT_NE(err.find("tensor 'half' [20]: shards hold 10 of 20 elements"), std::string::npos) << err;
  EXPECT_EQ(latest_dir(root), (fs::path(root) / step_dir_name(1)).string());
  fs::remove_all(root);
}

TEST(CkptTools, ReshardAndSafetensorsRoundTrip) {
  const std::string root = temp_root("tools");
  save_virtual(root, kCfg, parse_mesh("pp=2,tp=2"), 4);
  const std::string dst = root + "/resharded";
  const ReshardStats rs = reshard(root, dst, "ep=3,dp=6,zero=1", 2);
  EXPECT_DOUBLE_EQ(rs.amplification, 1.0);
  const Metadata m = read_metadata(resolve_checkpoint(dst));
  EXPECT_EQ(m.world, 6);
  EXPECT_EQ(m.find("layers.0.moe.experts.w_in")->shards.size(), 3u);  // 5 experts over ep=3
  EXPECT_EQ(verify_checkpoint(resolve_checkpoint(dst)).problems.size(), 0u);
  EXPECT_EQ(load_all(dst, kCfg, parse_mesh("tp=4"), 4), 0);

  const std::string st = root + "/model.safetensors";
  const auto ex = export_safetensors(root, st, 2);
  EXPECT_EQ(ex.tensors, demo_tensors(kCfg).size());
  const std::string text = keel::read_file(st);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(text[i]);
  const auto header = nlohmann::json::parse(text.substr(8, n));
  EXPECT_EQ(header["embed.weight"]["dtype"], "BF16");
  EXPECT_EQ(header["embed.weight"]["shape"], (std::vector<int>{101, 24}));
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string imp = root + "/imported";
  import_safetensors(st, imp, std::nullopt, 2);
  EXPECT_EQ(read_metadata(resolve_checkpoint(imp)).step, 4);
  EXPECT_EQ(load_all(imp, kCfg, parse_mesh("dp=2,ep=2,tp=2"), 4), 0);

  // Damaged safetensors files give one clear error (into a new root: `imp` holds a checkpoint).
  const std::string fresh = root + "/fresh";
  std::ofstream(root + "/short.safetensors") << "abc";
  EXPECT_NE(error_of([&] { import_safetensors(root + "/short.safetensors", fresh, 9, 1); }).find("not a safetensors file"),
            std::string::npos);
  const std::string cut = text.substr(0, text.size() - 10);
  std::ofstream(root + "/cut.safetensors", std::ios::binary).write(cut.data(), cut.size());
  EXPECT_NE(error_of([&] { import_safetensors(root + "/cut.safetensors", fresh, 9, 1); }).find("truncated"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(fresh));
  fs::remove_all(root);
}

// find_overlap against all pairs, on random boxes and on tilings cut along one dimension (the
// cases the sweep dimension is chosen for).
TEST(CkptGeometry, FindOverlapMatchesBruteForce) {
  std::mt19937 g(5);
  const Shape shape = {12, 10, 3};
  for (int iter = 0; iter < 400; ++iter) {
    std::vector<Box> boxes;
    const int n = 1 + static_cast<int>(g() % 6);
    for (int i = 0; i < n; ++i) boxes.push_back(random_box(g, shape));
    bool any = false;
    for (std::size_t a = 0; a < boxes.size() && !any; ++a)
      for (std::size_t b = a + 1; b < boxes.size() && !any; ++b) any = intersect(boxes[a], boxes[b]).has_value();
    const auto got = find_overlap(boxes);
    ASSERT_EQ(got.has_value(), any);
    if (got) {
      EXPECT_LT(got->first, got->second);
      EXPECT_TRUE(intersect(boxes[got->first], boxes[got->second]));
    }
  }
  // Columns of a matrix (every box spans dimension 0): disjoint, then one widened by a column.
  std::vector<Box> columns;
  for (std::int64_t c = 0; c < 64; ++c) columns.push_back(Box{{0, c}, {100, 1}});
  EXPECT_FALSE(find_overlap(columns));
  columns[40].lengths[1] = 2;
  const auto hit = find_overlap(columns);
  ASSERT_TRUE(hit);
  EXPECT_EQ(std::make_pair(hit->first, hit->second), std::make_pair(std::size_t{40}, std::size_t{41}));
  EXPECT_TRUE(find_overlap({Box{}, Box{}}));  // a 0-d tensor's one element, twice
}

// Two stored shards that overlap and leave a hole hold the right element count: the load, and so
// reshard and export, must refuse them instead of filling the hole with garbage.
TEST(CkptFaults, OverlappingShardsWithAHoleAreRefusedOnLoad) {
  const std::string root = temp_root("overlap");
  save_virtual(root, kCfg, parse_mesh("tp=2"), 3);
  const std::string dir = resolve_checkpoint(root);
  edit_metadata(dir, [](nlohmann::json& j) {
    for (auto& t : j["tensors"])
      if (t["name"] == "lm_head.weight") t["shards"][1]["offsets"][0] = t["shards"][1]["offsets"][0].get<int>() - 1;
  });
  const Reader r(root);
  std::vector<char> buf(101 * 24 * 2);
  const std::string err =
      error_of([&] { r.load({{"lm_head.weight", ElemType::kBF16, {101, 24}, full_box({101, 24}), buf.data()}}); });
  EXPECT_NE(err.find("tensor 'lm_head.weight': stored shards [0:51, 0:24] (in data_r00000_b"), std::string::npos) << err;
  EXPECT_NE(err.find("and [50:100, 0:24] (in data_r00000_b"), std::string::npos) << err;
  EXPECT_NE(err.find("overlap in [50:51, 0:24]"), std::string::npos) << err;
  // A box that reads only one of them still loads.
  EXPECT_EQ(error_of([&] { r.load({{"lm_head.weight", ElemType::kBF16, {101, 24}, Box{{0, 0}, {40, 24}}, buf.data()}}); }),
            "(no error)");
  const std::string dst = root + "/resharded";
  EXPECT_NE(error_of([&] { reshard(root, dst, "dp=1", 1); }).find("overlap in [50:51, 0:24]"), std::string::npos);
  EXPECT_FALSE(fs::exists(dst));
  EXPECT_NE(error_of([&] { export_safetensors(root, root + "/m.safetensors", 1); }).find("overlap"), std::string::npos);
  fs::remove_all(root);
}

TEST(CkptLayout, RepeatedAxesAndMeshesBeyondTheWorldBoundAreErrors) {
  EXPECT_NE(error_of([] { parse_mesh("tp=2,tp=4"); }).find("layout 'tp=2,tp=4': tp is given twice"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh("zero=1,dp=2,zero=0"); }).find("zero is given twice"), std::string::npos);
  // 65536 x 65536 overflows int: once an empty mesh that resharded into an empty checkpoint.
  EXPECT_NE(error_of([] { parse_mesh("dp=65536,tp=65536"); })
                .find("layout 'dp=65536,tp=65536': pp*dp*cp*tsp*tp = 4294967296 ranks, more than the 1048576 keel supports"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh("pp=2000000000"); }).find("pp=2000000000 is more than"), std::string::npos);
  EXPECT_EQ(parse_mesh("dp=1024,tp=1024").world(), mesh::kMaxWorld);
  EXPECT_NE(error_of([] { parse_demo_config("layers=2,layers=3"); }).find("layers is given twice"), std::string::npos);
  EXPECT_NE(error_of([] { parse_demo_config("layers=2x"); }).find("'2x' is not an integer"), std::string::npos);
}

TEST(CkptLayout, PlacementsOutsideTheMeshAreRejected) {
  auto placement = [](const std::string& text) { return error_of([&] { placement_from_json(nlohmann::json::parse(text)); }); };
  // pp_unit 9 of 4 names no pipeline stage: every rank would skip the tensor.
  EXPECT_NE(placement(R"({"dims": [[]], "pp_unit": 9, "pp_units": 4})").find("\"pp_unit\" is 9, not an integer in [-1, 3]"),
            std::string::npos);
  EXPECT_NE(placement(R"({"dims": [[]], "pp_unit": 0, "pp_units": 0})").find("\"pp_units\" is 0"), std::string::npos);
  EXPECT_NE(placement(R"({"dims": [["tp"], ["tp"]]})").find("uses axis \"tp\" twice"), std::string::npos);
  EXPECT_NE(placement(R"({"dims": [["mp"]]})").find("axis \"mp\" is not one of"), std::string::npos);
  EXPECT_NE(placement(R"({"dims": 3})").find("no \"dims\" array"), std::string::npos);
  EXPECT_EQ(placement(R"({"dims": [["tp"], []], "zero": true, "pp_unit": 3, "pp_units": 4})"), "(no error)");
}

TEST(CkptTypes, ElementAndByteCountsAreChecked) {
  EXPECT_EQ(numel({}), 1);
  EXPECT_EQ(numel({3, 0, 5}), 0);
  EXPECT_EQ(byte_size({2, 3}, ElemType::kBF16), 12u);
  EXPECT_NE(error_of([] { numel({4294967296, 4294967296}); }).find("more elements than a 64-bit count holds"),
            std::string::npos);
  EXPECT_NE(error_of([] { byte_size({std::int64_t{1} << 61, 2}, ElemType::kF32); }).find("more bytes"), std::string::npos);
  EXPECT_NE(error_of([] { numel({2, -1}); }).find("negative dimension"), std::string::npos);
  // Offsets near the int64 limit must not wrap into "inside".
  EXPECT_FALSE(box_within(Box{{INT64_MAX - 1}, {4}}, {8}));
}

// A tensor whose size overflows int64 with data_offsets [0, 0] once imported as an empty one.
TEST(CkptSafetensors, ElementCountsBeyondInt64AreRejectedNamingTheTensor) {
  const std::string root = temp_root("st_overflow");
  const std::string file = root + "/big.safetensors";
  for (const Shape& shape : {Shape{4294967296, 4294967296}, Shape{std::int64_t{1} << 62, 4}, Shape{std::int64_t{1} << 61, 2}}) {
    write_raw_safetensors(file, {{"huge", {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {0, 0}}}}}, 0);
    const std::string err = error_of([&] { import_safetensors(file, root + "/out", std::nullopt, 1); });
    EXPECT_NE(err.find("big.safetensors: tensor 'huge': shape " + shape_str(shape)), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(root + "/out"));
  }
  fs::remove_all(root);
}

// Every way metadata.json can hold the wrong type is one error naming the file and the member,
// thrown as keel::Error (so verify reports it and goes on); tensors must be an array of
// uniquely named tensors.
TEST(CkptMetadata, MalformedFieldsNameTheFileAndTheKey) {
  const std::string root = temp_root("malformed");
  save_virtual(root, kCfg, parse_mesh("tp=2"), 1);
  save_virtual(root, kCfg, parse_mesh("tp=2"), 2);
  const std::string dir = resolve_checkpoint(root);
  const std::string good = keel::read_file((fs::path(dir) / kMetadataFile).string());
  auto parse_with = [&](const std::function<void(nlohmann::json&)>& edit) {
    auto j = nlohmann::json::parse(good);
    edit(j);
    try {
      parse_metadata(j.dump(), "x/metadata.json");
    } catch (const keel::Error& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not a keel::Error: ") + e.what();
    }
    return std::string("(no error)");
  };
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](auto& j) { j["version"] = "1"; }, "x/metadata.json: \"version\" is \"1\", not an integer"},
      {[](auto& j) { j["format"] = 5; }, "x/metadata.json: not a keel checkpoint metadata file"},
      {[](auto& j) { j["tensors"] = nullptr; }, "x/metadata.json: \"tensors\" is null, not an array"},
      {[](auto& j) { j["tensors"] = nlohmann::json::object(); }, "x/metadata.json: \"tensors\" is {}, not an array"},
      {[](auto& j) { j["tensors"].push_back(j["tensors"][0]); }, "x/metadata.json: tensor 'embed.weight' is listed twice"},
      {[](auto& j) { j["tensors"][0]["name"] = 5; }, "x/metadata.json: tensors[0].name is 5, not a string"},
      {[](auto& j) { j["step"] = "7"; }, "x/metadata.json: \"step\" is \"7\", not an integer"},
      {[](auto& j) { j["world"] = 1.5; }, "x/metadata.json: \"world\" is 1.5, not an integer"},
      {[](auto& j) { j.erase("layout"); }, "x/metadata.json: \"layout\" is missing"},
      {[](auto& j) { j["state"] = 3; }, "x/metadata.json: \"state\" is 3, not an object"},
      {[](auto& j) { j["files"]["../etc"] = 1; }, "x/metadata.json: \"files\" names '../etc'"},
      {[](auto& j) { j["tensors"][0]["shards"][0]["crc32c"] = -1; },
       "x/metadata.json: tensor 'embed.weight': tensors[0].shards[0].crc32c is -1, not an integer in [0, 4294967295]"},
      {[](auto& j) { j["tensors"][0]["shape"] = {-3, 24}; },
       "x/metadata.json: tensor 'embed.weight': tensors[0].shape is [-3,24], not a list of non-negative integers"},
      {[](auto& j) { j["tensors"][0]["placement"]["pp_unit"] = 9; },
       "x/metadata.json: tensor 'embed.weight': placement \"pp_unit\" is 9, not an integer in [-1, 3]"},
      {[](auto& j) { j["tensors"][0]["placement"]["dims"] = nlohmann::json::parse(R"([["tp"]])"); },
       "x/metadata.json: tensor 'embed.weight': its placement has 1 dimensions, its shape [101, 24]"},
  };
  for (const auto& [edit, want] : cases) {
    const std::string err = parse_with(edit);
    EXPECT_NE(err.find(want), std::string::npos) << err << "\n  wanted: " << want;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
  // verify --all reports the damaged step and goes on to the others.
  edit_metadata(dir, [](nlohmann::json& j) { j["version"] = "1"; });
  std::FILE* out = std::tmpfile();
  EXPECT_EQ(verify(root, true, out), 1);
  std::rewind(out);
  std::string text(1 << 16, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), out));
  std::fclose(out);
  EXPECT_NE(text.find("\"version\" is \"1\", not an integer"), std::string::npos) << text;
  EXPECT_NE(text.find("verified " + (fs::path(root) / step_dir_name(1)).string()), std::string::npos) << text;
  fs::remove_all(root);
}

// Names keel never writes (too many digits for int64, another spelling) are not step
// directories: listings skip them, retention leaves them, a `latest` naming one is an error.
TEST(CkptStore, OutOfRangeAndOtherStepNamesAreNotStepDirectories) {
  std::int64_t step = -1;
  EXPECT_TRUE(parse_step_dir_name("step_00000042", &step));
  EXPECT_EQ(step, 42);
  EXPECT_TRUE(parse_step_dir_name("step_123456789", &step));
  EXPECT_FALSE(parse_step_dir_name("step_99999999999999999999", &step));
  EXPECT_FALSE(parse_step_dir_name("step_42", &step));
  EXPECT_FALSE(parse_step_dir_name("step_-0000005", &step));
  EXPECT_FALSE(parse_step_dir_name("step_", &step));
  const std::string root = temp_root("stepnames");
  save_virtual(root, kCfg, parse_mesh("dp=1"), 1);
  fs::create_directories(fs::path(root) / "step_99999999999999999999");
  fs::create_directories(fs::path(root) / "step_0");
  ASSERT_EQ(list_steps(root).size(), 1u);
  EXPECT_EQ(apply_retention(root, 1, 0), std::vector<std::string>{});
  EXPECT_TRUE(fs::exists(fs::path(root) / "step_0"));
  EXPECT_EQ(verify_quietly(root), 0);
  keel::write_file_atomically((fs::path(root) / kLatestFile).string(), "step_99999999999999999999\n");
  EXPECT_NE(error_of([&] { resolve_checkpoint(root); }).find("does not name a step directory ('step_99999999999999999999')"),
            std::string::npos);
  fs::remove_all(root);
}

// Export never writes into the checkpoint it reads (nor its root's latest and step
// directories), whatever the spelling of the path, and replaces an existing file only when told.
TEST(CkptTools, ExportRefusesToReplaceTheCheckpointOrAnExistingFile) {
  const std::string root = temp_root("export_target");
  save_virtual(root, kCfg, parse_mesh("tp=2"), 1);
  save_virtual(root, kCfg, parse_mesh("tp=2"), 2);
  const std::vector<std::string> before = entries_of(root);
  const std::string step2 = (fs::path(root) / step_dir_name(2)).string();
  fs::create_symlink(step2, root + "_link");
  const std::string data = read_metadata(step2).files.begin()->first;
  for (const std::string& out : {step2 + "/metadata.json", step2 + "/" + data, step2 + "/new.safetensors",
                                 root + "/../" + fs::path(root).filename().string() + "/" + step_dir_name(2) + "/metadata.json",
                                 root + "_link/metadata.json"}) {
    const std::string err = error_of([&] { export_safetensors(root, out, 1, /*overwrite=*/true); });
    EXPECT_NE(err.find(out + ": lies inside the checkpoint"), std::string::npos) << err;
  }
  for (const std::string& out : {root + "/latest", root + "/" + step_dir_name(1) + "/metadata.json"}) {
    const std::string err = error_of([&] { export_safetensors(root, out, 1, true); });
    EXPECT_NE(err.find(out + ": is part of the checkpoint root"), std::string::npos) << err;
  }
  EXPECT_EQ(entries_of(root), before);
  EXPECT_EQ(verify_quietly(root), 0);
  // Any other existing file: only with overwrite (--force). Beside the steps in the root is fine.
  const std::string file = root + "/model.safetensors";
  std::ofstream(file) << "mine";
  EXPECT_NE(error_of([&] { export_safetensors(root, file, 1); }).find(file + ": exists; pass --force to replace it"),
            std::string::npos);
  EXPECT_EQ(keel::read_file(file), "mine");
  export_safetensors(root, file, 1, true);
  EXPECT_EQ(SafetensorsFile(file).entries().size(), demo_tensors(kCfg).size());
  EXPECT_NE(error_of([&] { export_safetensors(root, root, 1, true); }).find("is a directory"), std::string::npos);
  fs::remove(root + "_link");
  fs::remove_all(root);
}

// reshard and import write new roots: one that holds checkpoints (latest at a newer step) or
// any step_* directory is refused before anything is written, so its latest and its other
// directories stay as they were.
TEST(CkptTools, ReshardAndImportRefuseARootThatHoldsCheckpoints) {
  const std::string root = temp_root("existing_dst");
  save_virtual(root + "/src", kCfg, parse_mesh("tp=2"), 3);
  export_safetensors(root + "/src", root + "/m.safetensors", 1);
  save_virtual(root + "/newer", kCfg, parse_mesh("dp=1"), 9);
  fs::create_directories(root + "/newer/" + step_dir_name(5));
  std::ofstream(root + "/newer/" + step_dir_name(5) + "/notes.txt") << "mine";
  fs::create_directories(root + "/stray/step_0050");
  const std::vector<std::string> newer = entries_of(root + "/newer"), stray = entries_of(root + "/stray");
  for (const std::string& dst : {root + "/newer", root + "/stray", root + "/src"}) {
    const std::string a = error_of([&] { reshard(root + "/src", dst, "tp=2", 1); });
    const std::string b = error_of([&] { import_safetensors(root + "/m.safetensors", dst, std::nullopt, 1); });
    for (const std::string& err : {a, b}) {
      EXPECT_NE(err.find(dst + ": already holds"), std::string::npos) << err;
      EXPECT_NE(err.find("the destination must be a new checkpoint root"), std::string::npos) << err;
    }
  }
  EXPECT_NE(error_of([&] { reshard(root + "/src", root + "/src/" + step_dir_name(3), "tp=2", 1); })
                .find("is a checkpoint directory"),
            std::string::npos);
  EXPECT_EQ(entries_of(root + "/newer"), newer);
  EXPECT_EQ(entries_of(root + "/stray"), stray);
  EXPECT_EQ(latest_dir(root + "/newer"), root + "/newer/" + step_dir_name(9));
  // A new directory, or an existing one without checkpoints, is a fine destination.
  fs::create_directories(root + "/empty");
  std::ofstream(root + "/empty/README") << "x";
  EXPECT_EQ(reshard(root + "/src", root + "/empty", "dp=2", 1).dir, root + "/empty/" + step_dir_name(3));
  fs::remove_all(root);
}

// A tensor no rank writes -- one with no elements -- is still declared, so reshard keeps it.
TEST(CkptTools, ReshardKeepsEveryTensorEmptyOnesIncluded) {
  const std::string root = temp_root("empty_tensor");
  const std::string file = root + "/ab.safetensors";
  write_raw_safetensors(file,
                        {{"a", {{"dtype", "F32"}, {"shape", {0, 5}}, {"data_offsets", {0, 0}}}},
                         {"b", {{"dtype", "F32"}, {"shape", nlohmann::json::array({2})}, {"data_offsets", {0, 8}}}}},
                        8);
  import_safetensors(file, root + "/imported", std::nullopt, 1);
  reshard(root + "/imported", root + "/resharded", "tp=2", 1);
  const Metadata m = read_metadata(resolve_checkpoint(root + "/resharded"));
  ASSERT_EQ(m.tensors.size(), 2u);
  EXPECT_EQ(m.find("a")->shape, (Shape{0, 5}));
  EXPECT_TRUE(m.find("a")->shards.empty());
  EXPECT_EQ(verify_checkpoint(resolve_checkpoint(root + "/resharded")).problems.size(), 0u);
  fs::remove_all(root);
}

// Negative steps: refused by the Saver (a step_-0000005 directory would make the root
// unreadable) and by import; import's "not given" is not a value a user can pass.
TEST(CkptSaveLoad, NegativeStepsAreRefusedAndImportHonoursAnyGivenStep) {
  const std::string root = temp_root("negative_step");
  auto comm = make_self_comm();
  Saver saver(*comm, root + "/neg");
  std::vector<float> one(1, 1.f);
  mesh::Placement p;
  const std::string err = error_of([&] {
    saver.save(-5, {{"x", ElemType::kF32, {}, p, Box{}, one.data(), true}}, {}, {}, "");
  });
  EXPECT_NE(err.find("cannot save step -5: steps are non-negative"), std::string::npos) << err;
  EXPECT_TRUE(list_steps(root + "/neg").empty());
  EXPECT_FALSE(fs::exists(root + "/neg/" + kLatestFile));
  save_virtual(root + "/src", kCfg, parse_mesh("dp=1"), 4);
  export_safetensors(root + "/src", root + "/m.safetensors", 1);
  EXPECT_NE(error_of([&] { import_safetensors(root + "/m.safetensors", root + "/a", -7, 1); }).find("step -7 is negative"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(root + "/a"));
  EXPECT_EQ(import_safetensors(root + "/m.safetensors", root + "/b", std::nullopt, 1).step, 4);  // the file's step
  EXPECT_EQ(import_safetensors(root + "/m.safetensors", root + "/c", 0, 1).step, 0);              // 0 as given
  fs::remove_all(root);
}

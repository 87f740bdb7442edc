// The checkpoint library in one process: checksum, geometry and the interval index against
// brute force, layouts (uneven and empty shards, one writer per distinct shard), metadata
// versioning, save -> load across layouts bit for bit, and every fault the issue lists.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

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

namespace fs = std::filesystem;
using namespace keel::ckpt;

namespace {

std::string temp_root(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / fmt::format("keel_ckpt_{}_{}", name, ::getpid());
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// Saves the demo state of every rank of `mesh` from this one process (as the offline tools
// do): the shards each virtual rank writes, committed as one checkpoint.
SaveStats save_virtual(const std::string& root, const DemoConfig& cfg, const Mesh& mesh, std::int64_t step,
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
std::int64_t load_all(const std::string& path, const DemoConfig& cfg, const Mesh& mesh, std::int64_t step,
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

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const keel::Error& e) {
    return e.what();
  }
  return "(no error)";
}

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

}  // namespace

TEST(CkptChecksum, KnownVectorAndIncremental) {
  EXPECT_EQ(crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c(0, "", 0), 0u);
  std::vector<char> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 + 7);
  const std::uint32_t whole = crc32c(0, data.data(), data.size());
  EXPECT_EQ(crc32c(crc32c(0, data.data(), 333), data.data() + 333, 667), whole);
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
  EXPECT_EQ(parse_mesh("pp=2,ep=2,tp=2,zero=1").world(), 8);
  EXPECT_NE(error_of([] { parse_mesh("tp=3", 4); }).find("spans 3 ranks, but 4 ranks"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh("mp=2"); }).find("unknown axis 'mp'"), std::string::npos);
  // 5 rows over 4 ranks: 2, 2, 1, 0 (an empty shard).
  Placement p;
  p.dims = {{"tp"}, {}};
  const Mesh m = parse_mesh("tp=4");
  std::vector<std::int64_t> lens;
  for (int r = 0; r < 4; ++r) lens.push_back(rank_shard({5, 3}, p, m, r, 0).box.lengths[0]);
  EXPECT_EQ(lens, (std::vector<std::int64_t>{2, 2, 1, 0}));
  EXPECT_FALSE(rank_shard({5, 3}, p, m, 3, 0).writer);  // empty shards are not written
}

// For many meshes: writers' boxes cover each demo tensor exactly once, replicated tensors
// are written by exactly one rank, and the writing is spread over ranks.
TEST(CkptLayout, OneWriterPerDistinctShard) {
  const auto tensors = demo_tensors(kCfg);
  for (const char* layout : {"dp=1", "dp=4,zero=1", "tp=3", "ep=4", "pp=2,dp=2", "pp=3,ep=2,tp=2,zero=1", "dp=2,ep=3,tp=2"}) {
    const Mesh mesh = parse_mesh(layout);
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
// pipeline stages), bit-identical with read amplification 1.
TEST(CkptSaveLoad, AnyLayoutToAnyOther) {
  const std::string root = temp_root("any");
  const Mesh saved = parse_mesh("dp=2,tp=2,zero=1");
  save_virtual(root, kCfg, saved, 5);
  for (const char* layout : {"dp=1", "tp=2", "ep=3", "dp=3,zero=1", "pp=2,ep=2,tp=2", "dp=8,zero=1", "pp=4,tp=2"}) {
    double amp = 0;
    EXPECT_EQ(load_all(root, kCfg, parse_mesh(layout), 5, &amp), 0) << layout;
    EXPECT_DOUBLE_EQ(amp, 1.0) << layout;
  }
  fs::remove_all(root);
}

TEST(CkptSaveLoad, AsyncOneInFlightAndRetention) {
  const std::string root = temp_root("retention");
  const Mesh mesh = parse_mesh("tp=2");
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

TEST(CkptSaveLoad, ReservedStagingIsUsedAndRefusedWhileASaveIsInFlight) {
  const std::string root = temp_root("reserve");
  const Mesh mesh = parse_mesh("tp=2");
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
  const Mesh mesh = parse_mesh("tp=2");
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
  const Mesh mesh = parse_mesh("tp=2");
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
  Placement p;
  p.dims = {{"tp"}};
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
  const ReshardStats rs = reshard(root, dst, "ep=3,dp=2,zero=1", 2);
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
  import_safetensors(st, imp, -1, 2);
  EXPECT_EQ(read_metadata(resolve_checkpoint(imp)).step, 4);
  EXPECT_EQ(load_all(imp, kCfg, parse_mesh("ep=2,tp=2"), 4), 0);

  // Damaged safetensors files give one clear error.
  std::ofstream(root + "/short.safetensors") << "abc";
  EXPECT_NE(error_of([&] { import_safetensors(root + "/short.safetensors", imp, 9, 1); }).find("not a safetensors file"),
            std::string::npos);
  const std::string cut = text.substr(0, text.size() - 10);
  std::ofstream(root + "/cut.safetensors", std::ios::binary).write(cut.data(), cut.size());
  EXPECT_NE(error_of([&] { import_safetensors(root + "/cut.safetensors", imp, 9, 1); }).find("truncated"),
            std::string::npos);
  fs::remove_all(root);
}

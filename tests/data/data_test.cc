// The data pipeline: Megatron indexed datasets, tokenizers, samples, shuffling, resume, blends.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "data/blend.h"
#include "data/indexed_dataset.h"
#include "data/sampler.h"
#include "data/tokenizer.h"
#include "../error_message.h"

namespace keel::data {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("keel_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
  static inline int counter_ = 0;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Random documents with ids in [1, max_id]: never all zeros.
std::vector<std::vector<std::uint32_t>> random_docs(std::uint32_t seed, int n, std::uint32_t max_id, int max_len) {
  std::mt19937 g(seed);
  std::vector<std::vector<std::uint32_t>> docs(n);
  for (int d = 0; d < n; ++d) {
    const int len = d == 3 ? 0 : 1 + static_cast<int>(g() % static_cast<std::uint32_t>(max_len));  // one empty document
    for (int i = 0; i < len; ++i) docs[d].push_back(1 + g() % max_id);
  }
  return docs;
}

void write_dataset(const std::string& prefix, TokenDtype dtype, const std::vector<std::vector<std::uint32_t>>& docs) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_document(d);
  w.finish();
}

std::string error_of(const std::function<void()>& f) { return test::error_message(f, "(no error)"); }

// ---- indexed dataset ----

void round_trip(TokenDtype dtype, std::uint32_t max_id) {
  TempDir dir;
  const auto docs = random_docs(static_cast<std::uint32_t>(dtype) * 7 + 1, 50, max_id, 300);
  write_dataset(dir / "ds", dtype, docs);
  IndexedDataset ds(dir / "ds");
  EXPECT_EQ(ds.dtype(), dtype);
  ASSERT_EQ(ds.documents(), docs.size());
  ASSERT_EQ(ds.sequences(), docs.size());
  std::uint64_t total = 0, ptr = 0;
  bool any_large = false;
  for (std::size_t d = 0; d < docs.size(); ++d) {
    EXPECT_EQ(ds.sequence(d), docs[d]) << "document " << d;
    EXPECT_EQ(ds.pointer(d), static_cast<std::int64_t>(ptr));
    ptr += docs[d].size() * dtype_bytes(dtype);
    total += docs[d].size();
    for (auto t : docs[d]) any_large = any_large || t > 0xFFFF;
  }
  EXPECT_EQ(ds.tokens(), total);
  EXPECT_EQ(ds.bin_bytes(), total * dtype_bytes(dtype));
  const auto di = ds.document_indices();
  ASSERT_EQ(di.size(), docs.size() + 1);
  for (std::size_t d = 0; d < di.size(); ++d) EXPECT_EQ(di[d], static_cast<std::int64_t>(d));
  if (max_id > 0xFFFF) EXPECT_TRUE(any_large);
  // A partial read from the middle of a document.
  std::vector<std::uint32_t> part(5);
  ds.read(0, 1, 5, part.data());
  EXPECT_EQ(part, std::vector<std::uint32_t>(docs[0].begin() + 1, docs[0].begin() + 6));
}

TEST(DataIndexed, RoundTripUint16) { round_trip(TokenDtype::kUint16, 0xFFFF); }
TEST(DataIndexed, RoundTripInt32) { round_trip(TokenDtype::kInt32, 262143); }
TEST(DataIndexed, RoundTripUint32) { round_trip(TokenDtype::kUint32, 0xFFFFFFFEu); }

TEST(DataIndexed, MegatronLayoutBytes) {
  TempDir dir;
  write_dataset(dir / "tiny", TokenDtype::kUint16, {{1, 2, 0x0304}, {0xABCD}});
  // Hand-computed: magic, version 1, dtype code 8 (uint16), 2 sequences, 3 document entries,
  // lengths int32 {3, 1}, pointers int64 {0, 6}, document indices int64 {0, 1, 2}.
  const unsigned char expected_idx[] = {
      'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0,  // magic
      1, 0, 0, 0, 0, 0, 0, 0,                   // version
      8,                                        // dtype code
      2, 0, 0, 0, 0, 0, 0, 0,                   // sequence count
      3, 0, 0, 0, 0, 0, 0, 0,                   // document count (+1)
      3, 0, 0, 0, 1, 0, 0, 0,                   // lengths
      0, 0, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0,                          // pointers
      0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0,  // doc idx
  };
  EXPECT_EQ(slurp(dir / "tiny.idx"), std::string(reinterpret_cast<const char*>(expected_idx), sizeof(expected_idx)));
  const unsigned char expected_bin[] = {1, 0, 2, 0, 0x04, 0x03, 0xCD, 0xAB};
  EXPECT_EQ(slurp(dir / "tiny.bin"), std::string(reinterpret_cast<const char*>(expected_bin), sizeof(expected_bin)));
  // int32 tokens: code 4, pointers in 4-byte units.
  write_dataset(dir / "wide", TokenDtype::kInt32, {{1, 2, 0x0304}, {0xABCD}});
  const std::string wide = slurp(dir / "wide.idx");
  EXPECT_EQ(static_cast<unsigned char>(wide[17]), 4);
  EXPECT_EQ(static_cast<unsigned char>(wide[34 + 8 + 8]), 12);  // second pointer = 3 tokens * 4 bytes
}

TEST(DataIndexed, WriterRejectsTokensTooWide) {
  TempDir dir;
  IndexedDatasetWriter w(dir / "x", TokenDtype::kUint16);
  const std::vector<std::uint32_t> doc = {5, 70000};
  EXPECT_NE(error_of([&] { w.add_document(doc); }).find("token id 70000 in document 0 does not fit uint16"),
            std::string::npos);
}

TEST(DataIndexed, ValidationErrorsNameTheFile) {
  TempDir dir;
  const std::string p = dir / "ds";
  write_dataset(p, TokenDtype::kUint16, random_docs(5, 10, 1000, 50));
  const std::string idx = slurp(p + ".idx"), bin = slurp(p + ".bin");
  auto expect_error = [&](const std::string& idx_bytes, const std::string& bin_bytes, const std::string& want) {
    spit(p + ".idx", idx_bytes);
    spit(p + ".bin", bin_bytes);
    const std::string e = error_of([&] { IndexedDataset ds(p); });
    EXPECT_NE(e.find(want), std::string::npos) << "got: " << e << "\nwanted: " << want;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  expect_error(idx, bin, "(no error)");

  EXPECT_NE(error_of([&] { IndexedDataset ds(dir / "missing"); }).find("cannot open " + (dir / "missing") + ".idx"),
            std::string::npos);
  std::string bad = idx;
  bad[0] = 'X';
  expect_error(bad, bin, p + ".idx: not a Megatron indexed dataset (bad magic");
  bad = idx;
  bad[9] = 2;
  expect_error(bad, bin, p + ".idx: unsupported index version 2");
  bad = idx;
  bad[17] = 6;
  expect_error(bad, bin, p + ".idx: unsupported token dtype code 6");
  expect_error(idx.substr(0, 20), bin, p + ".idx: truncated index (20 bytes, the header alone is 34)");
  expect_error(idx.substr(0, 5), bin, p + ".idx: not a Megatron indexed dataset");
  expect_error(idx.substr(0, idx.size() - 8), bin, p + ".idx: truncated index");
  expect_error(idx + "xyz", bin, p + ".idx: 3 unexpected bytes");
  expect_error(idx, bin.substr(0, bin.size() - 2), p + ".bin: truncated");
  // Issue 34: a larger .bin (another dataset's, or this one with more appended) was accepted and
  // trained on the wrong tokens: the sizes must agree exactly.
  const std::uint64_t tokens = bin.size() / 2;
  expect_error(idx, bin + "ab", fmt::format("{}.bin: {} bytes, but {}.idx describes {} uint16 tokens ({} bytes): the "
                                            "two files are not one dataset",
                                            p, bin.size() + 2, p, tokens, bin.size()));
  expect_error(idx, bin + bin, fmt::format("{}.bin: {} bytes, but", p, 2 * bin.size()));
  // A pointer past the end of the .bin (sequence 4's pointer, at 34 + 10*4 + 4*8).
  bad = idx;
  const std::int64_t far = 1 << 20;
  std::memcpy(bad.data() + 34 + 40 + 32, &far, 8);
  expect_error(bad, bin, p + ".idx: a sequence points past the end of " + p + ".bin");
  bad = idx;
  const std::int64_t odd = 3;
  std::memcpy(bad.data() + 34 + 40 + 32, &odd, 8);
  expect_error(bad, bin, p + ".idx: corrupt index (sequence 4 has pointer 3)");
  // Document boundaries that do not end at the sequence count.
  bad = idx;
  const std::int64_t nine = 9;
  std::memcpy(bad.data() + bad.size() - 8, &nine, 8);
  expect_error(bad, bin, p + ".idx: corrupt document boundaries");
  // A header claiming far more sequences than the file holds.
  bad = idx;
  const std::uint64_t huge = 1ULL << 40;
  std::memcpy(bad.data() + 18, &huge, 8);
  expect_error(bad, bin, p + ".idx: truncated index (242 bytes; 1099511627776 sequences and 11 document entries need");
}

TEST(DataIndexed, DtypeNames) {
  EXPECT_EQ(parse_dtype("uint32"), TokenDtype::kUint32);
  EXPECT_EQ(dtype_for_vocab(259), TokenDtype::kUint16);
  EXPECT_EQ(dtype_for_vocab(262144), TokenDtype::kInt32);
  EXPECT_THROW(parse_dtype("int8"), UsageError);
}

// ---- tokenizers ----

TEST(DataTokenizer, ByteRoundTripAndSpecials) {
  ByteTokenizer t;
  const std::string text = "Grüße, 世界! 3 + 4 = 7\n";
  const auto ids = t.encode(text);
  EXPECT_EQ(ids.size(), text.size());
  EXPECT_EQ(t.decode(ids), text);
  const std::vector<std::uint32_t> s = {ByteTokenizer::kBos, 'h', 'i', ByteTokenizer::kEos, ByteTokenizer::kPad};
  EXPECT_EQ(t.decode(s), "<s>hi</s><pad>");
  EXPECT_EQ(t.vocab_size(), 259u);
  EXPECT_EQ(*t.eos(), 258u);
}

// A SentencePiece model built in the test, without the trainer: a serialized ModelProto of a
// character model (sentencepiece_model.proto: pieces = 1 {piece = 1, score = 2, type = 3},
// trainer_spec = 2 {model_type = 3: CHAR = 4}; unk/bos/eos default to ids 0/1/2).
std::string varint(std::uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
  return out;
}
std::string field_bytes(int num, const std::string& payload) {
  return varint(static_cast<std::uint64_t>(num) << 3 | 2) + varint(payload.size()) + payload;
}
std::string field_varint(int num, std::uint64_t v) { return varint(static_cast<std::uint64_t>(num) << 3) + varint(v); }
std::string field_float(int num, float f) {
  std::string out = varint(static_cast<std::uint64_t>(num) << 3 | 5);
  out.append(reinterpret_cast<const char*>(&f), 4);
  return out;
}

std::string char_model() {
  auto piece = [](const std::string& text, int type) {
    return field_bytes(1, field_bytes(1, text) + field_float(2, 0.0f) + field_varint(3, static_cast<std::uint64_t>(type)));
  };
  std::string m = piece("<unk>", 2) + piece("<s>", 3) + piece("</s>", 3) + piece("\xe2\x96\x81", 1);  // U+2581
  for (char c = 'a'; c <= 'z'; ++c) m += piece(std::string(1, c), 1);
  m += field_bytes(2, field_varint(3, 4));  // trainer_spec.model_type = CHAR
  return m;
}

TEST(DataTokenizer, SentencePieceCharacterModel) {
  const auto t = load_sentencepiece_proto(char_model(), "char.model");
  EXPECT_EQ(t->vocab_size(), 30u);
  EXPECT_EQ(*t->bos(), 1u);
  EXPECT_EQ(*t->eos(), 2u);
  EXPECT_FALSE(t->pad().has_value());
  const auto ids = t->encode("ab ca");
  // "▁ab▁ca": the dummy prefix and the space become U+2581 (id 3); 'a' is id 4.
  EXPECT_EQ(ids, (std::vector<std::uint32_t>{3, 4, 5, 3, 6, 4}));
  EXPECT_EQ(t->decode(ids), "ab ca");
  std::vector<std::uint32_t> with_eos = ids;
  with_eos.push_back(2);
  EXPECT_EQ(t->decode(with_eos), "ab ca</s>");
  // And through a file, as `--tokenizer spm:FILE` loads it.
  TempDir dir;
  spit(dir / "char.model", char_model());
  const auto f = make_tokenizer("spm:" + (dir / "char.model"));
  EXPECT_EQ(f->encode("zz"), (std::vector<std::uint32_t>{3, 29, 29}));
  EXPECT_EQ(f->name(), "spm:" + (dir / "char.model"));
}

TEST(DataTokenizer, SentencePieceErrors) {
  TempDir dir;
  EXPECT_NE(error_of([&] { make_tokenizer("spm:" + (dir / "nope.model")); })
                .find("cannot read SentencePiece model " + (dir / "nope.model") + ": no such file"),
            std::string::npos);
  spit(dir / "garbage.model", "this is not a model");
  // Issue 34: SentencePiece's own text ("Internal: ./src/sentencepiece_processor.cc(1101)
  // [model_proto->ParseFromArray(...)]") is replaced by what it means for the file.
  EXPECT_EQ(error_of([&] { make_tokenizer("spm:" + (dir / "garbage.model")); }),
            "cannot load SentencePiece model " + (dir / "garbage.model") +
                ": not a SentencePiece model (its bytes do not parse as a serialized ModelProto, as spm_train writes)");
  EXPECT_EQ(error_of([&] { load_sentencepiece_proto("this is not a model", "g.model"); }),
            "cannot load SentencePiece model g.model: not a SentencePiece model (its bytes do not parse as a "
            "serialized ModelProto, as spm_train writes)");
  // a directory: read through std::filebuf it failed as "basic_filebuf::underflow ...", no path
  EXPECT_EQ(error_of([&] { make_tokenizer("spm:" + (dir / "")); }),
            "cannot read SentencePiece model " + (dir / "") + ": it is a directory (expected a .model file)");
  EXPECT_THROW(make_tokenizer("gpt2"), UsageError);
}

// ---- samples, shuffle, resume ----

// Token = doc * 1000 + position + 1, so a sample shows where each token came from.
std::vector<std::vector<std::uint32_t>> traceable_docs(int n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<std::vector<std::uint32_t>> docs(n);
  for (int d = 0; d < n; ++d) {
    const int len = 1 + static_cast<int>(g() % 90);
    for (int i = 0; i < len; ++i) docs[d].push_back(static_cast<std::uint32_t>(d * 1000 + i + 1));
  }
  return docs;
}

TEST(DataSampler, PermutationIsSeededAndComplete) {
  const auto a = seeded_permutation(1000, 42), b = seeded_permutation(1000, 42), c = seeded_permutation(1000, 43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (std::uint64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  // Pinned: the order must not change with the compiler or library.
  EXPECT_EQ(seeded_permutation(5, 1), seeded_permutation(5, 1));
  std::uint64_t s = 0;
  EXPECT_EQ(splitmix64(s), 0xE220A8397B1DCDAFULL);
}

TEST(DataSampler, UnshuffledSamplesAreTheStream) {
  TempDir dir;
  const auto docs = traceable_docs(30, 1);
  write_dataset(dir / "ds", TokenDtype::kInt32, docs);
  IndexedDataset ds(dir / "ds");
  SequenceSampler s(ds, 16, 7, /*shuffle=*/false);
  std::vector<std::uint32_t> stream;
  for (const auto& d : docs) stream.insert(stream.end(), d.begin(), d.end());
  EXPECT_EQ(s.samples_per_epoch(), (stream.size() - 1) / 16);
  for (std::uint64_t j = 0; j < s.samples_per_epoch(); ++j)
    ASSERT_EQ(s.sample(j), std::vector<std::uint32_t>(stream.begin() + j * 16, stream.begin() + j * 16 + 17));
  EXPECT_EQ(s.sample(s.samples_per_epoch()), s.sample(0));  // epoch 1 without shuffling = epoch 0
}

TEST(DataSampler, ShuffledSamplesAreWindowsOfAnEpochStream) {
  TempDir dir;
  const auto docs = traceable_docs(40, 2);
  write_dataset(dir / "ds", TokenDtype::kUint16, docs);
  IndexedDataset ds(dir / "ds");
  SequenceSampler s(ds, 32, 11);
  const std::uint64_t n = s.samples_per_epoch();
  for (std::uint64_t e = 0; e < 3; ++e) {
    std::vector<std::uint32_t> firsts;
    for (std::uint64_t i = 0; i < n; ++i) {
      const auto smp = s.sample(e * n + i);
      for (std::size_t k = 1; k < smp.size(); ++k) {
        const std::uint32_t a = smp[k - 1] - 1, b = smp[k] - 1;
        const bool same_doc_next = b / 1000 == a / 1000 && b % 1000 == a % 1000 + 1;
        const bool doc_switch = a % 1000 + 1 == docs[a / 1000].size() && b % 1000 == 0;
        ASSERT_TRUE(same_doc_next || doc_switch) << "epoch " << e << " sample " << i;
      }
      firsts.push_back(smp[0]);
    }
    std::sort(firsts.begin(), firsts.end());
    EXPECT_EQ(std::unique(firsts.begin(), firsts.end()), firsts.end());  // every window once
  }
  EXPECT_NE(s.sample(0), s.sample(n));  // epochs are reshuffled (almost surely)
  SequenceSampler again(ds, 32, 11), other(ds, 32, 12);
  EXPECT_EQ(again.sample(5), s.sample(5));
  bool differ = false;
  for (std::uint64_t i = 0; i < n; ++i) differ = differ || other.sample(i) != s.sample(i);
  EXPECT_TRUE(differ);
}

TEST(DataSampler, TooSmallDataset) {
  TempDir dir;
  write_dataset(dir / "ds", TokenDtype::kUint16, {{1, 2, 3}});
  IndexedDataset ds(dir / "ds");
  EXPECT_NE(error_of([&] { SequenceSampler s(ds, 8, 1); }).find("3 tokens, fewer than one sample of seq_length + 1 = 9"),
            std::string::npos);
}

std::vector<std::vector<std::uint32_t>> run_batches(SampleStream& stream, std::uint64_t gb, int rank, int world, int n,
                                                    const nlohmann::json* resume = nullptr,
                                                    nlohmann::json* saved = nullptr) {
  BatchLoader loader(stream, gb, rank, world);
  if (resume) loader.restore(nlohmann::json::parse(resume->dump()));  // through text, as from a file
  std::vector<std::vector<std::uint32_t>> out;
  for (int i = 0; i < n; ++i) out.push_back(loader.next_batch());
  if (saved) *saved = loader.state();
  return out;
}

TEST(DataSampler, ResumeReproducesTheUninterruptedRun) {
  TempDir dir;
  write_dataset(dir / "ds", TokenDtype::kUint16, traceable_docs(10, 3));
  IndexedDataset ds(dir / "ds");
  SequenceSampler s(ds, 20, 99);
  ASSERT_LT(s.samples_per_epoch() * 2, 8u * 12);  // the run crosses epochs
  SingleStream full(s);
  const auto all = run_batches(full, 8, 0, 1, 12);
  SingleStream first(s);
  nlohmann::json state;
  auto part = run_batches(first, 8, 0, 1, 5, nullptr, &state);
  EXPECT_EQ(state["consumed_samples"], 40u);
  EXPECT_EQ(state["epoch"].get<std::uint64_t>() * s.samples_per_epoch() + state["index"].get<std::uint64_t>(), 40u);
  EXPECT_GE(state["epoch"].get<std::uint64_t>(), 1u);  // saved after an epoch boundary
  SingleStream fresh(s);
  const auto rest = run_batches(fresh, 8, 0, 1, 7, &state);
  part.insert(part.end(), rest.begin(), rest.end());
  EXPECT_EQ(part, all);

  // A state from another seed is refused.
  SequenceSampler other(ds, 20, 100);
  SingleStream wrong(other);
  EXPECT_NE(error_of([&] { wrong.restore(state); }).find("saved for seed 99"), std::string::npos);
}

TEST(DataSampler, GlobalOrderIndependentOfWorldSize) {
  TempDir dir;
  write_dataset(dir / "ds", TokenDtype::kUint16, traceable_docs(25, 4));
  IndexedDataset ds(dir / "ds");
  SequenceSampler s(ds, 16, 5);
  SingleStream one(s);
  const auto single = run_batches(one, 8, 0, 1, 6);
  const std::size_t row = 17;
  std::vector<std::vector<std::vector<std::uint32_t>>> ranks;
  for (int r = 0; r < 4; ++r) {
    SingleStream st(s);
    ranks.push_back(run_batches(st, 8, r, 4, 6));
  }
  for (int b = 0; b < 6; ++b) {
    std::vector<std::uint32_t> merged(8 * row);
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(ranks[r][b].size(), 2 * row);
      for (int k = 0; k < 2; ++k)  // rank r's k-th row is global row r + 4k
        std::copy(ranks[r][b].begin() + k * row, ranks[r][b].begin() + (k + 1) * row, merged.begin() + (r + 4 * k) * row);
    }
    EXPECT_EQ(merged, single[b]) << "batch " << b;
  }
  // Saved at 1 rank, resumed at 2: the same global order continues.
  SingleStream a(s);
  nlohmann::json state;
  run_batches(a, 8, 0, 1, 3, nullptr, &state);
  SingleStream r0(s), r1(s);
  const auto b0 = run_batches(r0, 8, 0, 2, 3, &state), b1 = run_batches(r1, 8, 1, 2, 3, &state);
  for (int b = 0; b < 3; ++b)
    for (int k = 0; k < 4; ++k) {
      const auto& src = (k % 2 == 0 ? b0 : b1)[b];
      const std::size_t kk = static_cast<std::size_t>(k / 2);
      EXPECT_TRUE(std::equal(src.begin() + kk * row, src.begin() + (kk + 1) * row, single[3 + b].begin() + k * row));
    }
  EXPECT_THROW(BatchLoader(a, 6, 0, 4), UsageError);
}

// ---- blends and phases ----

struct BlendFixture {
  TempDir dir;
  std::vector<std::unique_ptr<IndexedDataset>> ds;
  std::vector<std::unique_ptr<SequenceSampler>> samplers;
  std::vector<const SequenceSampler*> ptrs;
  explicit BlendFixture(int n, std::uint64_t seq = 16) {
    for (int i = 0; i < n; ++i) {
      const std::string p = dir / ("d" + std::to_string(i));
      write_dataset(p, TokenDtype::kUint16, traceable_docs(10 + i, 10 + static_cast<std::uint32_t>(i)));
      ds.push_back(std::make_unique<IndexedDataset>(p));
      samplers.push_back(std::make_unique<SequenceSampler>(*ds.back(), seq, 7 + static_cast<std::uint64_t>(i)));
      ptrs.push_back(samplers.back().get());
    }
  }
};

TEST(DataBlend, WeightsHonouredWithinOneSample) {
  BlendFixture f(3);
  BlendStream b(f.ptrs, {{"only", 0, {0.5, 0.3, 0.2}}});
  std::vector<double> n(3, 0);
  const double w[3] = {0.5, 0.3, 0.2};
  for (int c = 1; c <= 20000; ++c) {
    const auto ref = b.next();
    EXPECT_EQ(ref.index, static_cast<std::uint64_t>(n[ref.source]));  // each dataset continues its own order
    n[ref.source] += 1;
    for (int d = 0; d < 3; ++d) ASSERT_LE(std::abs(n[d] - w[d] * c), 1.0) << "after " << c << " samples";
  }
  // Irregular weights too.
  BlendStream odd(f.ptrs, {{"only", 0, {0.61, 0.001, 0.389}}});
  std::vector<double> m(3, 0);
  for (int c = 1; c <= 20000; ++c) {
    m[odd.next().source] += 1;
    ASSERT_LE(std::abs(m[0] - 0.61 * c), 1.0);
    ASSERT_LE(std::abs(m[1] - 0.001 * c), 1.0);
    ASSERT_LE(std::abs(m[2] - 0.389 * c), 1.0);
  }
}

TEST(DataBlend, PhasesSwitchAtTheirTokenCount) {
  BlendFixture f(2, 64);
  // Phase 1: 1000 tokens = ceil(1000 / 64) = 16 samples of dataset 0; phase 2: 640 tokens = 10 samples of
  // dataset 1; phase 3: half and half.
  BlendStream b(f.ptrs, {{"a", 1000, {1, 0}}, {"b", 640, {0, 1}}, {"c", 0, {0.5, 0.5}}});
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(b.next().source, 0u) << i;
    EXPECT_EQ(b.phase(), 0u);
  }
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(b.next().source, 1u) << i;
    EXPECT_EQ(b.phase(), 1u);
  }
  EXPECT_EQ(b.phase_start(2), 26u);
  int zeros = 0;
  for (int i = 0; i < 100; ++i) zeros += b.next().source == 0;
  EXPECT_EQ(b.phase(), 2u);
  EXPECT_EQ(zeros, 50);
}

TEST(DataBlend, ResumeAcrossAPhaseBoundary) {
  BlendFixture f(3);
  const std::vector<PhaseConfig> phases = {{"a", 16 * 37, {0.7, 0.3, 0}}, {"b", 0, {0.2, 0.3, 0.5}}};
  BlendStream full(f.ptrs, phases);
  const auto all = run_batches(full, 8, 0, 1, 10);
  BlendStream first(f.ptrs, phases);
  nlohmann::json state;
  auto part = run_batches(first, 8, 0, 1, 4, nullptr, &state);  // 32 samples: inside phase a (37 samples)
  BlendStream second(f.ptrs, phases);
  auto more = run_batches(second, 8, 0, 1, 2, &state, &state);  // crosses into phase b
  EXPECT_EQ(state["phase"], 1u);
  BlendStream third(f.ptrs, phases);
  const auto rest = run_batches(third, 8, 0, 1, 4, &state);
  part.insert(part.end(), more.begin(), more.end());
  part.insert(part.end(), rest.begin(), rest.end());
  EXPECT_EQ(part, all);
}

TEST(DataConfig, ParsesAndRejectsBadConfigs) {
  const std::string good = R"(seq_length: 128
seed: 9
datasets:
  web: corpus/web
  code: /abs/code
phases:
  - name: warm
    tokens: 2B
    weights: {web: 0.7, code: 0.3}
  - weights: {web: 1, code: 3}
)";
  const DataConfig c = parse_data_config(good, "cfg.yaml", "/base");
  EXPECT_EQ(c.seq_length, 128u);
  EXPECT_EQ(c.seed, 9u);
  EXPECT_EQ(c.prefixes[0], "/base/corpus/web");
  EXPECT_EQ(c.prefixes[1], "/abs/code");
  EXPECT_EQ(c.phases[0].tokens, 2000000000u);
  EXPECT_EQ(c.phases[0].name, "warm");
  EXPECT_DOUBLE_EQ(c.phases[1].weights[1], 0.75);

  auto err = [&](const std::string& text) { return error_of([&] { parse_data_config(text, "cfg.yaml", ""); }); };
  EXPECT_EQ(err("seq_length: 8\nsed: 1\ndatasets: {a: x}\nphases: [{weights: {a: 1}}]\n"),
            "cfg.yaml: unknown key 'sed' (allowed: seq_length, seed, shuffle, datasets, phases) (line 2)");
  EXPECT_NE(err("seq_length: 8\ndatasets: {a: x}\nphases:\n  - weights: {a: 1}\n    weight: 2\n")
                .find("cfg.yaml: unknown key 'weight' in phase 1"),
            std::string::npos);
  EXPECT_NE(err("seq_length: 8\ndatasets: {a: x}\nphases:\n  - weights: {b: 1}\n").find("weighs unknown dataset 'b' (line 4)"),
            std::string::npos);
  EXPECT_NE(err("seq_length: 8\ndatasets: {a: x}\nphases:\n  - weights: {a: 1}\n  - weights: {a: 1}\n")
                .find("phase 'phase1' needs 'tokens'"),
            std::string::npos);
  EXPECT_NE(err("seq_length: 8\ndatasets: {a: x}\nphases:\n  - {tokens: 5Q, weights: {a: 1}}\n").find("unknown unit"),
            std::string::npos);
  EXPECT_NE(err("seq_length: 8\ndatasets: {a: x}\nphases:\n  - weights: {a: -1}\n").find("must be >= 0"),
            std::string::npos);
  EXPECT_NE(err("seq_length: 0\ndatasets: {a: x}\nphases:\n  - weights: {a: 1}\n").find("at least 1"), std::string::npos);
  EXPECT_NE(err("datasets: {a: x}\nphases: []\n").find("missing 'seq_length'"), std::string::npos);
  EXPECT_NE(err("seq_length: [\n").find("invalid YAML"), std::string::npos);
}

// Issue 34: every YAML keel reads is bounded: its size before reading (/dev/zero was read until
// the OOM killer), its nodes with aliases expanded, and its strings must be UTF-8.
TEST(DataConfig, BoundedAndUtf8) {
  auto load_error = [](const std::string& path) { return error_of([&] { load_data_config(path); }); };
  EXPECT_EQ(load_error("/dev/zero"), "cannot read /dev/zero: it is a character device, not a config file");
  TempDir dir;
  const std::string big = dir / "big.yaml";
  spit(big, "");
  fs::resize_file(big, (std::uint64_t{16} << 20) + 1);  // sparse: nothing allocated
  EXPECT_EQ(load_error(big), "cannot read " + big + ": 16777217 bytes is too large for a config file (at most 16 MiB): is "
                             "it the right file?");
  std::string bomb = "seq_length: 8\ndatasets: {a: x}\nphases: [{weights: {a: 1}}]\nx0: &x0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n";
  for (int i = 1; i <= 6; ++i) {
    bomb += fmt::format("x{}: &x{} [", i, i);
    for (int k = 0; k < 10; ++k) bomb += fmt::format("{}*x{}", k ? ", " : "", i - 1);
    bomb += "]\n";
  }
  EXPECT_EQ(error_of([&] { parse_data_config(bomb, "cfg.yaml", ""); }),
            "cfg.yaml: more than 1000000 values with its aliases expanded (aliases nested inside aliases?); a keel "
            "config holds a few hundred");
  EXPECT_EQ(error_of([&] { parse_data_config("seq_length: 8\ndatasets: {a: \"x\xff\"}\nphases: [{weights: {a: 1}}]\n",
                                             "cfg.yaml", ""); }),
            "cfg.yaml: key 'datasets.a' (line 2) is not valid UTF-8 (byte 0xff at offset 1); configs are stored in "
            "checkpoints as JSON, which needs UTF-8");
}

}  // namespace
}  // namespace keel::data

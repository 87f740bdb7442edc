// Megatron-LM's indexed token dataset (MMapIndexedDataset / megatron.core.datasets.IndexedDataset):
// PREFIX.bin holds the raw tokens of every sequence back to back; PREFIX.idx describes them.
// Files written here are read by Megatron and the other way round (uint32 excepted, below).
//
// PREFIX.idx, all little-endian (docs/data.md has the byte map):
//   9 bytes   magic "MMIDIDX\x00\x00"
//   u64       version, 1
//   u8        dtype code of the .bin tokens (Megatron's DType enum: 4 int32, 8 uint16;
//             9 uint32 is a keel extension Megatron does not know)
//   u64       sequence count S
//   u64       document count D (= documents + 1: the array below starts with 0)
//   i32[S]    tokens per sequence
//   i64[S]    byte offset of each sequence in the .bin
//   i64[D]    document boundaries: document d is sequences [doc[d], doc[d+1])
//   (i8[S]    sequence modes, only in Megatron's multimodal datasets: accepted, ignored)
//
// keel writes one sequence per document (as Megatron's preprocess_data.py does without
// sentence splitting); the reader accepts any valid grouping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keel::data {

enum class TokenDtype : std::uint8_t { kInt32 = 4, kUint16 = 8, kUint32 = 9 };

std::size_t dtype_bytes(TokenDtype dtype);
const char* dtype_name(TokenDtype dtype);
// "uint16", "int32", "uint32"; throws keel::UsageError otherwise.
TokenDtype parse_dtype(std::string_view text);
// Megatron's choice: uint16 below 65500 ids, int32 above (262K vocabularies fit in int32).
TokenDtype dtype_for_vocab(std::uint64_t vocab_size);
// Largest token id the dtype holds.
std::uint64_t dtype_max_token(TokenDtype dtype);

// Writes PREFIX.bin and PREFIX.idx. Both go to temporary files renamed into place by
// finish(), so a failed run never leaves a half-written dataset under PREFIX.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, TokenDtype dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one document of one sequence. Throws keel::Error when a token does not fit
  // the dtype.
  void add_document(std::span<const std::uint32_t> tokens);
  void finish();

  std::uint64_t documents() const { return lengths_.size(); }
  std::uint64_t tokens() const { return tokens_; }

 private:
  std::string prefix_, bin_tmp_, idx_tmp_;
  TokenDtype dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<std::int32_t> lengths_;
  std::uint64_t tokens_ = 0;
  std::vector<char> buffer_;
  bool finished_ = false;
};

// The bytes of a .idx file for these sequence lengths (one document per sequence).
std::string encode_index(TokenDtype dtype, std::span<const std::int32_t> lengths);

// Read-only view of PREFIX.{idx,bin} through mmap. The constructor validates everything the
// reader will rely on (magic, version, dtype, sizes against the file lengths, pointers inside
// the .bin, document boundaries) and throws keel::Error with one line naming the file.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  TokenDtype dtype() const { return dtype_; }
  std::uint64_t sequences() const { return sequence_count_; }
  std::uint64_t documents() const { return document_count_ - 1; }
  std::uint64_t tokens() const { return total_tokens_; }
  std::uint64_t idx_bytes() const { return idx_size_; }
  std::uint64_t bin_bytes() const { return bin_size_; }

  std::uint32_t length(std::uint64_t sequence) const;
  std::int64_t pointer(std::uint64_t sequence) const;
  // Document boundaries, documents() + 1 entries.
  std::vector<std::int64_t> document_indices() const;
  // Copies `count` tokens of `sequence` from `offset` into out (widened to uint32).
  void read(std::uint64_t sequence, std::uint64_t offset, std::uint64_t count, std::uint32_t* out) const;
  std::vector<std::uint32_t> sequence(std::uint64_t sequence) const;

 private:
  std::string prefix_;
  TokenDtype dtype_ = TokenDtype::kUint16;
  std::uint64_t sequence_count_ = 0, document_count_ = 0, total_tokens_ = 0;
  std::uint64_t idx_size_ = 0, bin_size_ = 0;
  const unsigned char* idx_ = nullptr;
  const unsigned char* bin_ = nullptr;
  const unsigned char* lengths_ = nullptr;
  const unsigned char* pointers_ = nullptr;
  const unsigned char* doc_idx_ = nullptr;
};

}  // namespace keel::data

#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "common/error.h"

namespace keel::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr std::uint64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // 34

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;  // little-endian hosts only (x86-64, aarch64), as Megatron's numpy reader
}

template <typename T>
void append(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

bool known_code(std::uint8_t code) { return code == 4 || code == 8 || code == 9; }

// Maps a whole file read-only; size 0 maps to nullptr.
const unsigned char* map_file(const std::string& path, std::uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail("cannot open {}: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("cannot stat {}: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{} is not a regular file", path);
  }
  *size = static_cast<std::uint64_t>(st.st_size);
  void* p = nullptr;
  if (*size > 0) {
    p = ::mmap(nullptr, *size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      fail("cannot mmap {}: {}", path, std::strerror(err));
    }
  }
  ::close(fd);
  return static_cast<const unsigned char*>(p);
}

}  // namespace

std::size_t dtype_bytes(TokenDtype dtype) { return dtype == TokenDtype::kUint16 ? 2 : 4; }

const char* dtype_name(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::kUint16: return "uint16";
    case TokenDtype::kInt32: return "int32";
    case TokenDtype::kUint32: return "uint32";
  }
  return "?";
}

TokenDtype parse_dtype(std::string_view text) {
  if (text == "uint16") return TokenDtype::kUint16;
  if (text == "int32") return TokenDtype::kInt32;
  if (text == "uint32") return TokenDtype::kUint32;
  throw UsageError(fmt::format("unknown token dtype '{}' (uint16, int32 or uint32)", text));
}

TokenDtype dtype_for_vocab(std::uint64_t vocab_size) {
  return vocab_size < 65500 ? TokenDtype::kUint16 : TokenDtype::kInt32;
}

std::uint64_t dtype_max_token(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::kUint16: return 0xFFFF;
    case TokenDtype::kInt32: return 0x7FFFFFFF;
    case TokenDtype::kUint32: return 0xFFFFFFFF;
  }
  return 0;
}

std::string encode_index(TokenDtype dtype, std::span<const std::int32_t> lengths) {
  std::string out;
  out.reserve(kHeaderBytes + lengths.size() * 20 + 8);
  out.append(kMagic, sizeof(kMagic));
  append<std::uint64_t>(out, 1);
  append<std::uint8_t>(out, static_cast<std::uint8_t>(dtype));
  append<std::uint64_t>(out, lengths.size());
  append<std::uint64_t>(out, lengths.size() + 1);
  for (std::int32_t n : lengths) append<std::int32_t>(out, n);
  std::int64_t ptr = 0;
  for (std::int32_t n : lengths) {
    append<std::int64_t>(out, ptr);
    ptr += static_cast<std::int64_t>(n) * static_cast<std::int64_t>(dtype_bytes(dtype));
  }
  for (std::size_t d = 0; d <= lengths.size(); ++d) append<std::int64_t>(out, static_cast<std::int64_t>(d));
  return out;
}

// ---- writer ----

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, TokenDtype dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  const std::string tag = ".tmp." + std::to_string(::getpid());
  bin_tmp_ = prefix_ + ".bin" + tag;
  idx_tmp_ = prefix_ + ".idx" + tag;
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  if (!bin_) fail("cannot write {}.bin: {}", prefix_, std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finished_) {
    ::unlink(bin_tmp_.c_str());
    ::unlink(idx_tmp_.c_str());
  }
}

void IndexedDatasetWriter::add_document(std::span<const std::uint32_t> tokens) {
  if (finished_) fail("{}: add_document after finish", prefix_);
  if (tokens.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    fail("{}: document {} has {} tokens, more than the format's int32 length", prefix_, lengths_.size(),
         tokens.size());
  const std::size_t w = dtype_bytes(dtype_);
  const std::uint64_t max = dtype_max_token(dtype_);
  buffer_.resize(tokens.size() * w);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::uint32_t t = tokens[i];
    if (t > max)
      fail("{}: token id {} in document {} does not fit {} (use a wider --dtype)", prefix_, t, lengths_.size(),
           dtype_name(dtype_));
    if (w == 2) {
      const std::uint16_t v = static_cast<std::uint16_t>(t);
      std::memcpy(buffer_.data() + 2 * i, &v, 2);
    } else {
      std::memcpy(buffer_.data() + 4 * i, &t, 4);
    }
  }
  if (!buffer_.empty() && std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) != buffer_.size())
    fail("cannot write {}.bin: {}", prefix_, std::strerror(errno));
  lengths_.push_back(static_cast<std::int32_t>(tokens.size()));
  tokens_ += tokens.size();
}

void IndexedDatasetWriter::finish() {
  if (finished_) return;
  if (std::fflush(bin_) != 0 || ::fsync(::fileno(bin_)) != 0) fail("cannot write {}.bin: {}", prefix_, std::strerror(errno));
  std::fclose(bin_);
  bin_ = nullptr;
  const std::string idx = encode_index(dtype_, lengths_);
  std::FILE* f = std::fopen(idx_tmp_.c_str(), "wb");
  if (!f) fail("cannot write {}.idx: {}", prefix_, std::strerror(errno));
  const bool ok = std::fwrite(idx.data(), 1, idx.size(), f) == idx.size() && std::fflush(f) == 0 &&
                  ::fsync(::fileno(f)) == 0;
  std::fclose(f);
  if (!ok) fail("cannot write {}.idx: {}", prefix_, std::strerror(errno));
  // The .bin first: a reader that finds the new .idx also finds its .bin.
  if (std::rename(bin_tmp_.c_str(), (prefix_ + ".bin").c_str()) != 0)
    fail("cannot write {}.bin: {}", prefix_, std::strerror(errno));
  if (std::rename(idx_tmp_.c_str(), (prefix_ + ".idx").c_str()) != 0)
    fail("cannot write {}.idx: {}", prefix_, std::strerror(errno));
  finished_ = true;
}

// ---- reader ----

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  idx_ = map_file(idx_path, &idx_size_);
  try {
    if (idx_size_ < sizeof(kMagic) || std::memcmp(idx_, kMagic, sizeof(kMagic)) != 0)
      fail("{}: not a Megatron indexed dataset (bad magic; expected \"MMIDIDX\\x00\\x00\")", idx_path);
    if (idx_size_ < kHeaderBytes)
      fail("{}: truncated index ({} bytes, the header alone is {})", idx_path, idx_size_, kHeaderBytes);
    const auto version = load<std::uint64_t>(idx_ + 9);
    if (version != 1) fail("{}: unsupported index version {} (expected 1)", idx_path, version);
    const auto code = load<std::uint8_t>(idx_ + 17);
    if (!known_code(code))
      fail("{}: unsupported token dtype code {} (4 int32, 8 uint16, 9 uint32)", idx_path, static_cast<int>(code));
    dtype_ = static_cast<TokenDtype>(code);
    sequence_count_ = load<std::uint64_t>(idx_ + 18);
    document_count_ = load<std::uint64_t>(idx_ + 26);
    // 128-bit: a corrupt header's counts must not wrap around.
    const unsigned __int128 want128 = static_cast<unsigned __int128>(kHeaderBytes) +
                                      static_cast<unsigned __int128>(sequence_count_) * (4 + 8) +
                                      static_cast<unsigned __int128>(document_count_) * 8;
    if (want128 > idx_size_) {
      const std::string need = want128 > std::numeric_limits<std::uint64_t>::max()
                                   ? std::string("more than 2^64")
                                   : std::to_string(static_cast<std::uint64_t>(want128));
      fail("{}: truncated index ({} bytes; {} sequences and {} document entries need {})", idx_path, idx_size_,
           sequence_count_, document_count_, need);
    }
    const auto want = static_cast<std::uint64_t>(want128);
    if (idx_size_ != want && idx_size_ != want + sequence_count_)
      fail("{}: {} unexpected bytes after the index (corrupt file?)", idx_path, idx_size_ - want);
    if (document_count_ < 1) fail("{}: corrupt index (no document boundaries)", idx_path);
    lengths_ = idx_ + kHeaderBytes;
    pointers_ = lengths_ + 4 * sequence_count_;
    doc_idx_ = pointers_ + 8 * sequence_count_;

    const auto first = load<std::int64_t>(doc_idx_);
    const auto last = load<std::int64_t>(doc_idx_ + 8 * (document_count_ - 1));
    if (first != 0 || last != static_cast<std::int64_t>(sequence_count_))
      fail("{}: corrupt document boundaries (from {} to {}, expected 0 to {})", idx_path, first, last,
           sequence_count_);
    for (std::uint64_t d = 1; d < document_count_; ++d)
      if (load<std::int64_t>(doc_idx_ + 8 * d) < load<std::int64_t>(doc_idx_ + 8 * (d - 1)))
        fail("{}: corrupt document boundaries (entry {} goes backwards)", idx_path, d);

    bin_ = map_file(bin_path, &bin_size_);
    const std::uint64_t w = dtype_bytes(dtype_);
    std::uint64_t need = 0;
    for (std::uint64_t i = 0; i < sequence_count_; ++i) {
      const auto n = load<std::int32_t>(lengths_ + 4 * i);
      if (n < 0) fail("{}: corrupt index (sequence {} has length {})", idx_path, i, n);
      total_tokens_ += static_cast<std::uint64_t>(n);
      const auto p = load<std::int64_t>(pointers_ + 8 * i);
      const std::uint64_t end = static_cast<std::uint64_t>(p) + static_cast<std::uint64_t>(n) * w;
      if (p < 0 || static_cast<std::uint64_t>(p) % w != 0 || end > std::numeric_limits<std::int64_t>::max())
        fail("{}: corrupt index (sequence {} has pointer {})", idx_path, i, p);
      if (end > need) need = end;
    }
    if (bin_size_ < need) {
      if (need == total_tokens_ * w)
        fail("{}: truncated ({} bytes; {} needs {} for its {} tokens)", bin_path, bin_size_, idx_path, need,
             total_tokens_);
      fail("{}: a sequence points past the end of {} ({} bytes, pointers reach {})", idx_path, bin_path, bin_size_,
           need);
    }
    if (bin_size_ % w != 0) fail("{}: {} bytes is not a whole number of {} tokens", bin_path, bin_size_, dtype_name(dtype_));
    // The .bin holds the index's tokens and nothing else (Megatron writes them back to back): a
    // larger one belongs to another index, and training would read the wrong tokens.
    if (bin_size_ != total_tokens_ * w)
      fail("{}: {} bytes, but {} describes {} {} tokens ({} bytes): the two files are not one dataset", bin_path,
           bin_size_, idx_path, total_tokens_, dtype_name(dtype_), total_tokens_ * w);
  } catch (...) {
    if (idx_) ::munmap(const_cast<unsigned char*>(idx_), idx_size_);
    if (bin_) ::munmap(const_cast<unsigned char*>(bin_), bin_size_);
    throw;
  }
}

IndexedDataset::~IndexedDataset() {
  if (idx_) ::munmap(const_cast<unsigned char*>(idx_), idx_size_);
  if (bin_) ::munmap(const_cast<unsigned char*>(bin_), bin_size_);
}

std::uint32_t IndexedDataset::length(std::uint64_t s) const {
  if (s >= sequence_count_) fail("{}: sequence {} out of range ({} sequences)", prefix_, s, sequence_count_);
  return static_cast<std::uint32_t>(load<std::int32_t>(lengths_ + 4 * s));
}

std::int64_t IndexedDataset::pointer(std::uint64_t s) const {
  if (s >= sequence_count_) fail("{}: sequence {} out of range ({} sequences)", prefix_, s, sequence_count_);
  return load<std::int64_t>(pointers_ + 8 * s);
}

std::vector<std::int64_t> IndexedDataset::document_indices() const {
  std::vector<std::int64_t> out(document_count_);
  for (std::uint64_t d = 0; d < document_count_; ++d) out[d] = load<std::int64_t>(doc_idx_ + 8 * d);
  return out;
}

void IndexedDataset::read(std::uint64_t s, std::uint64_t offset, std::uint64_t count, std::uint32_t* out) const {
  const std::uint64_t n = length(s);
  if (offset > n || count > n - offset)
    fail("{}: tokens [{}, {}) out of range of sequence {} ({} tokens)", prefix_, offset, offset + count, s, n);
  const unsigned char* p = bin_ + pointer(s) + offset * dtype_bytes(dtype_);
  if (dtype_ == TokenDtype::kUint16) {
    for (std::uint64_t i = 0; i < count; ++i) out[i] = load<std::uint16_t>(p + 2 * i);
  } else if (count > 0) {
    std::memcpy(out, p, 4 * count);
  }
}

std::vector<std::uint32_t> IndexedDataset::sequence(std::uint64_t s) const {
  std::vector<std::uint32_t> out(length(s));
  read(s, 0, out.size(), out.data());
  return out;
}

}  // namespace keel::data

// Text to token ids. Two tokenizers:
//
//   byte  ids 0..255 are the bytes of the UTF-8 text, then three special ids:
//         256 <pad>, 257 <s> (BOS), 258 </s> (EOS); vocabulary 259. Any text round-trips.
//   spm   a SentencePiece model file (spm:PATH): its own vocabulary and special ids.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keel::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;
  virtual std::uint32_t vocab_size() const = 0;
  virtual std::vector<std::uint32_t> encode(std::string_view text) const = 0;
  // Special ids decode to their names ("</s>").
  virtual std::string decode(std::span<const std::uint32_t> ids) const = 0;
  virtual std::optional<std::uint32_t> bos() const = 0;
  virtual std::optional<std::uint32_t> eos() const = 0;
  virtual std::optional<std::uint32_t> pad() const = 0;
};

class ByteTokenizer : public Tokenizer {
 public:
  static constexpr std::uint32_t kPad = 256, kBos = 257, kEos = 258, kVocab = 259;
  std::string name() const override { return "byte"; }
  std::uint32_t vocab_size() const override { return kVocab; }
  std::vector<std::uint32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const std::uint32_t> ids) const override;
  std::optional<std::uint32_t> bos() const override { return kBos; }
  std::optional<std::uint32_t> eos() const override { return kEos; }
  std::optional<std::uint32_t> pad() const override { return kPad; }
};

// Loads a SentencePiece .model file; throws keel::Error naming the file when it cannot.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);
// The same from a serialized ModelProto held in memory (`what` names it in errors).
std::unique_ptr<Tokenizer> load_sentencepiece_proto(const std::string& serialized, const std::string& what);

// "byte" or "spm:PATH"; throws keel::UsageError on anything else.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

}  // namespace keel::data

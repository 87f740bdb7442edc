#include "data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sys/stat.h>

#include "common/error.h"

namespace keel::data {

std::vector<std::uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<std::uint32_t> out(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string ByteTokenizer::decode(std::span<const std::uint32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (std::uint32_t id : ids) {
    if (id < 256) out.push_back(static_cast<char>(id));
    else if (id == kPad) out += "<pad>";
    else if (id == kBos) out += "<s>";
    else if (id == kEos) out += "</s>";
    else out += fmt::format("<unk:{}>", id);
  }
  return out;
}

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(std::string what) : what_(std::move(what)) {}
  sentencepiece::SentencePieceProcessor& sp() { return sp_; }

  std::string name() const override { return "spm:" + what_; }
  std::uint32_t vocab_size() const override { return static_cast<std::uint32_t>(sp_.GetPieceSize()); }
  std::vector<std::uint32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    if (!status.ok()) fail("{}: cannot encode: {}", what_, status.ToString());
    return {ids.begin(), ids.end()};
  }
  std::string decode(std::span<const std::uint32_t> ids) const override {
    // Decode runs of ordinary pieces; name control ids explicitly so they show.
    std::string out;
    std::vector<int> run;
    auto flush = [&] {
      if (run.empty()) return;
      std::string text;
      const auto status = sp_.Decode(run, &text);
      if (!status.ok()) fail("{}: cannot decode: {}", what_, status.ToString());
      out += text;
      run.clear();
    };
    for (std::uint32_t id : ids) {
      const int i = static_cast<int>(id);
      if (id >= vocab_size()) {
        flush();
        out += fmt::format("<unk:{}>", id);
      } else if (sp_.IsControl(i)) {
        flush();
        out += sp_.IdToPiece(i);
      } else {
        run.push_back(i);
      }
    }
    flush();
    return out;
  }
  std::optional<std::uint32_t> bos() const override { return special(sp_.bos_id()); }
  std::optional<std::uint32_t> eos() const override { return special(sp_.eos_id()); }
  std::optional<std::uint32_t> pad() const override { return special(sp_.pad_id()); }

 private:
  static std::optional<std::uint32_t> special(int id) {
    if (id < 0) return std::nullopt;
    return static_cast<std::uint32_t>(id);
  }
  std::string what_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

namespace {

// SentencePiece's status text names its own source ("Internal: ./src/sentencepiece_processor.cc(1101)
// [model_proto->ParseFromArray(...)] ", or in other releases "could not parse ModelProto from
// PATH"): say what it means for the file instead.
std::string load_failure(const std::string& what, const sentencepiece::util::Status& status) {
  const std::string text = status.ToString();
  if (text.find("ParseFromArray") != std::string::npos || text.find("could not parse ModelProto") != std::string::npos)
    return fmt::format("cannot load SentencePiece model {}: not a SentencePiece model (its bytes do not parse as a "
                       "serialized ModelProto, as spm_train writes)",
                       what);
  const char* raw = status.message();
  std::string msg(raw ? raw : "");
  // "./src/file.cc(123) [condition] message": keep the message
  if (msg.rfind("./", 0) == 0 || msg.rfind("src/", 0) == 0)
    if (const auto end = msg.find("] "); end != std::string::npos) msg = msg.substr(end + 2);
  while (!msg.empty() && msg.back() == ' ') msg.pop_back();
  return fmt::format("cannot load SentencePiece model {}: {}", what, msg.empty() ? text : msg);
}

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path) {
  struct stat st {};
  if (::stat(model_path.c_str(), &st) != 0)
    fail("cannot read SentencePiece model {}: no such file", model_path);
  // SentencePiece reads through std::filebuf, whose error for a directory names no file
  if (!S_ISREG(st.st_mode))
    fail("cannot read SentencePiece model {}: {} (expected a .model file)", model_path,
         S_ISDIR(st.st_mode) ? "it is a directory" : "not a regular file");
  auto t = std::make_unique<SentencePieceTokenizer>(model_path);
  const auto status = t->sp().Load(model_path);
  if (!status.ok()) fail("{}", load_failure(model_path, status));
  return t;
}

std::unique_ptr<Tokenizer> load_sentencepiece_proto(const std::string& serialized, const std::string& what) {
  auto t = std::make_unique<SentencePieceTokenizer>(what);
  const auto status = t->sp().LoadFromSerializedProto(serialized);
  if (!status.ok()) fail("{}", load_failure(what, status));
  return t;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  if (spec.rfind("spm:", 0) == 0 && spec.size() > 4) return load_sentencepiece(spec.substr(4));
  throw UsageError(fmt::format("unknown tokenizer '{}' (byte or spm:MODEL_FILE)", spec));
}

}  // namespace keel::data

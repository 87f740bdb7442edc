#include "data/command.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string_view>

#include "common/error.h"
#include "common/hash.h"
#include "common/process.h"
#include "common/units.h"
#include "data/blend.h"
#include "data/indexed_dataset.h"
#include "data/sampler.h"
#include "data/tokenizer.h"

namespace keel::data {
namespace {

struct TokenizeFlags {
  std::vector<std::string> inputs;
  std::string out, tokenizer = "byte", jsonl_key = "text", dtype = "auto";
  bool append_eos = false, quiet = false, force = false;
  double holdout = 0;  // fraction of documents written to PREFIX_heldout instead
};

bool is_jsonl(const std::string& path) {
  auto ends = [&](const char* s) {
    const std::size_t n = std::strlen(s);
    return path.size() >= n && path.compare(path.size() - n, n, s) == 0;
  };
  return ends(".jsonl") || ends(".json");
}

// Calls doc(text) for every document of one input file.
template <typename F>
void for_each_document(const std::string& path, const std::string& key, F&& doc) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(fmt::format("cannot read input {}: {}", path, std::strerror(errno)));
  std::string line;
  std::uint64_t line_no = 0;
  if (is_jsonl(path)) {
    while (std::getline(in, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        std::string why = e.what();
        if (const auto at = why.find("] "); at != std::string::npos) why = why.substr(at + 2);
        throw UsageError(fmt::format("{}:{}: not a JSON line ({})", path, line_no, why));
      }
      if (!j.is_object() || !j.contains(key) || !j.at(key).is_string())
        throw UsageError(fmt::format("{}:{}: no string field '{}' (set --jsonl-key)", path, line_no, key));
      doc(j.at(key).get_ref<const std::string&>());
    }
  } else {
    // Plain text: documents are separated by blank lines.
    std::string text;
    while (std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) {
        if (!text.empty()) doc(text);
        text.clear();
        continue;
      }
      if (!text.empty()) text += '\n';
      text += line;
    }
    if (!text.empty()) doc(text);
  }
  if (in.bad()) throw Error(fmt::format("cannot read input {}: {}", path, std::strerror(errno)));
}

int run_tokenize(const TokenizeFlags& f) {
  const auto tok = make_tokenizer(f.tokenizer);
  const TokenDtype dtype = f.dtype == "auto" ? dtype_for_vocab(tok->vocab_size()) : parse_dtype(f.dtype);
  if (tok->vocab_size() - 1 > dtype_max_token(dtype))
    throw UsageError(fmt::format("--dtype {} cannot hold the tokenizer's {} ids", dtype_name(dtype), tok->vocab_size()));
  if (f.append_eos && !tok->eos()) throw UsageError(fmt::format("--append-eos: tokenizer {} has no EOS id", tok->name()));
  for (const auto& in : f.inputs) {
    std::ifstream probe(in);
    if (!probe) throw UsageError(fmt::format("cannot read input {}: {}", in, std::strerror(errno)));
  }

  if (f.out.empty() || f.out.back() == '/' || std::filesystem::path(f.out).filename() == ".")
    throw UsageError(fmt::format("--out '{}': must name a file prefix (PREFIX.bin and PREFIX.idx are written)", f.out));
  if (!(f.holdout >= 0 && f.holdout < 1)) throw UsageError(fmt::format("--holdout must be in [0, 1), got {}", f.holdout));
  // A held-out split left by an earlier --holdout run of this prefix would now overlap the
  // new training set: eval on it would measure training data. Refused rather than deleted.
  const std::string held_prefix = f.out + "_heldout";
  if (f.holdout == 0)
    for (const char* ext : {".bin", ".idx"})
      if (std::filesystem::exists(held_prefix + ext))
        throw UsageError(fmt::format("{}{} is left from an earlier --holdout split of {}: it would overlap this "
                                     "dataset; remove {}.bin and {}.idx, or pass --holdout again",
                                     held_prefix, ext, f.out, held_prefix, held_prefix));
  // An existing dataset is replaced only with --force: a dataset can take days to make, and
  // `tokenize X.bin --out X` replaced its own input without a word.
  std::vector<std::string> outputs = {f.out + ".bin", f.out + ".idx"};
  if (f.holdout > 0) outputs.insert(outputs.end(), {held_prefix + ".bin", held_prefix + ".idx"});
  if (!f.force) {
    std::error_code eq;
    for (const auto& in : f.inputs)
      for (const auto& out : outputs)
        if (std::filesystem::equivalent(in, out, eq))
          throw UsageError(fmt::format("--out {} would replace the input {} (as {}) with its tokens: give another "
                                       "--out (or --force)",
                                       f.out, in, out));
    for (const auto& out : outputs)
      if (std::filesystem::exists(std::filesystem::symlink_status(out, eq)))
        throw UsageError(fmt::format("--out {}: {} already exists (an earlier dataset?): pass --force to replace it, "
                                     "or choose another prefix",
                                     f.out, out));
  }
  // Like any output path, the prefix's directory is made when missing.
  const std::filesystem::path parent = std::filesystem::path(f.out).parent_path();
  std::error_code ec;
  if (!parent.empty() && !std::filesystem::create_directories(parent, ec) && ec)
    throw Error(fmt::format("cannot create {}: {}", parent.string(), ec.message()));
  // Held-out documents: chosen by a hash of the document's position, so the split is the same
  // on every run and machine, spread over the whole input, and independent of document sizes.
  IndexedDatasetWriter w(f.out, dtype);
  std::unique_ptr<IndexedDatasetWriter> held;
  if (f.holdout > 0) held = std::make_unique<IndexedDatasetWriter>(held_prefix, dtype);
  const auto threshold = static_cast<std::uint64_t>(f.holdout * 18446744073709551616.0);
  std::uint64_t empty = 0, doc_index = 0;
  for (const auto& in : f.inputs) {
    for_each_document(in, f.jsonl_key, [&](const std::string& text) {
      auto ids = tok->encode(text);
      if (ids.empty()) {
        ++empty;
        return;
      }
      if (f.append_eos) ids.push_back(*tok->eos());
      const bool hold = held && ::keel::splitmix64(doc_index++ ^ 0x6b65656c686f6c64ull) < threshold;
      (hold ? *held : w).add_document(ids);
    });
  }
  if (w.documents() == 0)
    throw UsageError(fmt::format("no documents in the input ({}){}: nothing to write", fmt::join(f.inputs, ", "),
                                 held ? " left for training after --holdout" : ""));
  if (held && held->documents() == 0)
    throw UsageError(fmt::format("--holdout {}: none of the {} documents was held out; raise the fraction", f.holdout,
                                 w.documents()));
  w.finish();
  if (held) held->finish();
  if (!f.quiet) {
    std::printf("tokenized %zu file%s: %llu documents, %llu tokens (%s tokenizer, vocab %u, %s)%s\n", f.inputs.size(),
                f.inputs.size() == 1 ? "" : "s", static_cast<unsigned long long>(w.documents()),
                static_cast<unsigned long long>(w.tokens()), tok->name().c_str(), tok->vocab_size(), dtype_name(dtype),
                empty ? fmt::format(", {} empty skipped", empty).c_str() : "");
    std::printf("wrote %s.bin and %s.idx\n", f.out.c_str(), f.out.c_str());
    if (held)
      std::printf("held out %llu documents, %llu tokens (--holdout %g): wrote %s.bin and %s.idx\n",
                  static_cast<unsigned long long>(held->documents()), static_cast<unsigned long long>(held->tokens()),
                  f.holdout, held_prefix.c_str(), held_prefix.c_str());
  }
  return kExitOk;
}

struct InspectFlags {
  std::string prefix, tokenizer = "byte";
  std::uint64_t document = 0, tokens = 200;
};

std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out.push_back(static_cast<char>(c));
  }
  return out;
}

int run_inspect(const InspectFlags& f) {
  const IndexedDataset ds(f.prefix);
  std::printf("dataset    %s\n", f.prefix.c_str());
  std::printf("files      %s.idx (%s), %s.bin (%s)\n", f.prefix.c_str(), format_size(ds.idx_bytes()).c_str(),
              f.prefix.c_str(), format_size(ds.bin_bytes()).c_str());
  std::printf("dtype      %s (Megatron dtype code %d)\n", dtype_name(ds.dtype()), static_cast<int>(ds.dtype()));
  std::printf("documents  %llu\n", static_cast<unsigned long long>(ds.documents()));
  std::printf("sequences  %llu\n", static_cast<unsigned long long>(ds.sequences()));
  std::uint64_t lo = ds.sequences() ? ~0ULL : 0, hi = 0;
  for (std::uint64_t s = 0; s < ds.sequences(); ++s) {
    lo = std::min<std::uint64_t>(lo, ds.length(s));
    hi = std::max<std::uint64_t>(hi, ds.length(s));
  }
  std::printf("tokens     %llu (per sequence: min %llu, mean %.1f, max %llu)\n",
              static_cast<unsigned long long>(ds.tokens()), static_cast<unsigned long long>(lo),
              ds.sequences() ? static_cast<double>(ds.tokens()) / static_cast<double>(ds.sequences()) : 0.0,
              static_cast<unsigned long long>(hi));
  if (ds.documents() == 0) return kExitOk;
  if (f.document >= ds.documents())
    throw UsageError(fmt::format("--document {} is out of range ({} documents)", f.document, ds.documents()));
  const auto tok = make_tokenizer(f.tokenizer);
  const auto doc_idx = ds.document_indices();
  std::vector<std::uint32_t> ids;
  for (auto s = static_cast<std::uint64_t>(doc_idx[f.document]); s < static_cast<std::uint64_t>(doc_idx[f.document + 1]); ++s) {
    const auto seq = ds.sequence(s);
    ids.insert(ids.end(), seq.begin(), seq.end());
  }
  const std::size_t shown = std::min<std::size_t>(ids.size(), f.tokens);
  std::printf("document %llu: %zu tokens, first %zu decoded (%s):\n", static_cast<unsigned long long>(f.document),
              ids.size(), shown, tok->name().c_str());
  std::printf("  ids  [%s%s]\n", fmt::format("{}", fmt::join(ids.begin(), ids.begin() + std::min<std::size_t>(shown, 16), ", ")).c_str(),
              shown > 16 ? ", ..." : "");
  std::printf("  text \"%s\"\n", printable(tok->decode(std::span<const std::uint32_t>(ids.data(), shown))).c_str());
  return kExitOk;
}

struct BatchesFlags {
  std::string config, resume, save_state;
  std::uint64_t global_batch = 8, steps = 1;
  int rank = 0, world = 1;
  bool show_tokens = false;
};

// FNV-1a over the tokens' little-endian bytes (the same fingerprint on any host).
std::uint64_t fnv1a(const std::vector<std::uint32_t>& v) {
  std::uint64_t h = kFnv1aBasis;
  for (const std::uint32_t x : v) {
    const char bytes[4] = {static_cast<char>(x & 0xff), static_cast<char>((x >> 8) & 0xff),
                           static_cast<char>((x >> 16) & 0xff), static_cast<char>(x >> 24)};
    h = keel::fnv1a(std::string_view(bytes, 4), h);
  }
  return h;
}

int run_batches(const BatchesFlags& f) {
  const DataConfig cfg = load_data_config(f.config);
  DataPipeline pipe(cfg);
  BatchLoader loader(pipe.stream(), f.global_batch, f.rank, f.world);
  if (!f.resume.empty()) loader.restore(load_state(f.resume));
  const auto* blend = dynamic_cast<const BlendStream*>(&pipe.stream());
  for (std::uint64_t step = 0; step < f.steps; ++step) {
    const std::uint64_t first = pipe.stream().consumed_samples();
    std::vector<SampleRef> refs;
    const auto batch = loader.next_batch(&refs);
    std::string srcs;
    for (const auto& r : refs) srcs += fmt::format("{}{}:{}", srcs.empty() ? "" : " ", cfg.names[r.source], r.index);
    std::printf("batch samples %llu..%llu phase %s rank %d/%d hash %016llx  %s\n",
                static_cast<unsigned long long>(first),
                static_cast<unsigned long long>(first + f.global_batch - 1),
                blend ? cfg.phases[blend->phase()].name.c_str() : "-", f.rank, f.world,
                static_cast<unsigned long long>(fnv1a(batch)), srcs.c_str());
    if (f.show_tokens) {
      const std::uint64_t row = loader.row_tokens();
      for (std::uint64_t r = 0; r < loader.micro_rows(); ++r)
        std::printf("  row %llu: %s\n", static_cast<unsigned long long>(r),
                    fmt::format("{}", fmt::join(batch.begin() + r * row, batch.begin() + std::min<std::uint64_t>(r * row + 12, (r + 1) * row), " ")).c_str());
    }
  }
  if (!f.save_state.empty()) {
    save_state(f.save_state, loader.state());
    std::printf("state: %s (consumed_samples %llu)\n", f.save_state.c_str(),
                static_cast<unsigned long long>(pipe.stream().consumed_samples()));
  }
  return kExitOk;
}

// CLI11 reads "-1" into an unsigned option as 2^64 - 1: counts are refused when negative.
const CLI::Validator kNotNegative(
    [](std::string& text) {
      const auto first = text.find_first_not_of(" \t");
      return first != std::string::npos && text[first] == '-' ? std::string("must not be negative") : std::string();
    },
    "COUNT >= 0");

}  // namespace

void add_command(CLI::App& app) {
  CLI::App* data = app.add_subcommand("data", "Training data: tokenize text into Megatron indexed datasets, inspect "
                                               "them, and walk the batches of a data config");
  data->require_subcommand(1);

  auto t = std::make_shared<TokenizeFlags>();
  CLI::App* tok = data->add_subcommand(
      "tokenize", "Tokenize text (.txt: documents separated by blank lines) or JSONL (.jsonl/.json: one JSON object "
                  "per line) into PREFIX.bin + PREFIX.idx");
  tok->add_option("inputs", t->inputs, "Input files")->required();
  tok->add_option("-o,--out", t->out, "Output prefix (writes PREFIX.bin and PREFIX.idx)")->required();
  tok->add_option("--tokenizer", t->tokenizer, "byte, or spm:MODEL for a SentencePiece model file")
      ->capture_default_str();
  tok->add_option("--jsonl-key", t->jsonl_key, "Field of each JSONL object holding the text")->capture_default_str();
  tok->add_flag("--append-eos", t->append_eos, "End every document with the tokenizer's EOS id");
  tok->add_option("--holdout", t->holdout,
                  "Fraction of documents (chosen by a hash of their position, the same every run) written to "
                  "PREFIX_heldout instead, for eval.prefix")
      ->capture_default_str();
  tok->add_option("--dtype", t->dtype, "Token dtype: auto (uint16 below 65500 ids, else int32), uint16, int32, uint32")
      ->capture_default_str();
  tok->add_flag("--force", t->force,
                "Replace an existing dataset at --out (refused without it), even one that is an input");
  tok->add_flag("-q,--quiet", t->quiet, "No summary");
  tok->callback([t] { set_exit_code(run_tokenize(*t)); });

  auto i = std::make_shared<InspectFlags>();
  CLI::App* ins = data->add_subcommand("inspect", "Summarize an indexed dataset and decode one document");
  ins->add_option("prefix", i->prefix, "Dataset prefix (PREFIX.idx and PREFIX.bin)")->required();
  ins->add_option("--document", i->document, "Document to decode")->check(kNotNegative)->capture_default_str();
  ins->add_option("--tokens", i->tokens, "Tokens of it to decode")->check(kNotNegative)->capture_default_str();
  ins->add_option("--tokenizer", i->tokenizer, "byte, or spm:MODEL")->capture_default_str();
  ins->callback([i] { set_exit_code(run_inspect(*i)); });

  auto b = std::make_shared<BatchesFlags>();
  CLI::App* bat = data->add_subcommand(
      "batches", "Walk the global batches of a data config (blend, phases, shuffle) as one rank sees them");
  bat->add_option("config", b->config, "Data config YAML")->required();
  bat->add_option("--global-batch", b->global_batch, "Samples per global batch")
      ->check(kNotNegative)
      ->capture_default_str();
  bat->add_option("--steps", b->steps, "Batches to walk")->check(kNotNegative)->capture_default_str();
  bat->add_option("--rank", b->rank, "This rank")->check(kNotNegative)->capture_default_str();
  bat->add_option("--world", b->world, "Data-parallel ranks")->check(kNotNegative)->capture_default_str();
  bat->add_option("--resume", b->resume, "Start from a saved state file");
  bat->add_option("--save-state", b->save_state, "Write the state after the last batch");
  bat->add_flag("--show-tokens", b->show_tokens, "Print the first tokens of every row");
  bat->callback([b] { set_exit_code(run_batches(*b)); });
}

}  // namespace keel::data

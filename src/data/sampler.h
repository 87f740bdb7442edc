// Fixed-length training samples from an indexed dataset, in a seeded order that does not depend
// on the number of ranks and resumes exactly (docs/data.md, "Samples, shuffling and resume").
//
// Epoch e of a dataset of T tokens and S sequences:
//   1. the sequences are put in a seeded order (a permutation drawn from (seed, e)) and their
//      tokens concatenated into one stream of T tokens;
//   2. the stream is cut into N = floor((T - 1) / L) samples of L + 1 tokens, sample j covering
//      stream tokens [j*L, j*L + L] (inputs are the first L, labels the last L: consecutive samples
//      share one token, as in Megatron's GPTDataset); samples span sequence boundaries and the
//      last T - 1 - N*L tokens of an epoch are not used;
//   3. the N samples are visited in a second seeded order (a permutation drawn from (seed, e)).
// Global sample g is sample perm_e[g mod N] of epoch e = g / N: the order is a pure function of
// (dataset, L, seed), so any rank computes it and the whole position is one number.
//
// Global batch b is global samples [b*B, (b+1)*B). Rank r of a world of W ranks takes every W-th
// sample of it, b*B + r, b*B + r + W, ...: B / W samples. Interleaving the W ranks' parts gives
// the 1-rank batch back, so the data seen does not depend on W, and a saved position restored
// under another W still continues the same global order.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/indexed_dataset.h"

namespace keel::data {

// The seeded generator under every shuffle: splitmix64, and Fisher-Yates with unbiased bounded
// draws, both written out here so the order is the same with every compiler and library.
std::uint64_t splitmix64(std::uint64_t& state);
std::vector<std::uint64_t> seeded_permutation(std::uint64_t n, std::uint64_t seed);

class SequenceSampler {
 public:
  // Throws keel::Error when the dataset holds fewer than L + 1 tokens.
  SequenceSampler(const IndexedDataset& dataset, std::uint64_t seq_length, std::uint64_t seed, bool shuffle = true);

  const IndexedDataset& dataset() const { return ds_; }
  std::uint64_t seq_length() const { return seq_length_; }
  std::uint64_t seed() const { return seed_; }
  std::uint64_t samples_per_epoch() const { return per_epoch_; }
  // Global sample `index` (any index: epochs go on forever): seq_length + 1 tokens into out.
  void sample(std::uint64_t index, std::uint32_t* out) const;
  std::vector<std::uint32_t> sample(std::uint64_t index) const;

 private:
  struct Epoch {
    std::uint64_t number = 0;
    std::vector<std::uint64_t> order;   // sequence order of the epoch's stream
    std::vector<std::uint64_t> starts;  // stream offset of order[k]
    std::vector<std::uint64_t> perm;    // sample visiting order
  };
  std::shared_ptr<const Epoch> epoch(std::uint64_t e) const;

  const IndexedDataset& ds_;
  std::uint64_t seq_length_, seed_;
  bool shuffle_;
  std::uint64_t per_epoch_ = 0;
  mutable std::mutex mutex_;
  mutable std::vector<std::shared_ptr<const Epoch>> cache_;  // the two most recent epochs
};

// Where a sample stream stands and which sample it hands out next.
struct SampleRef {
  std::uint32_t source = 0;  // dataset index (0 for a single dataset)
  std::uint64_t index = 0;   // global sample index within that dataset's sampler
};

// A global, world-size-independent sequence of samples with a resumable position.
class SampleStream {
 public:
  virtual ~SampleStream() = default;
  virtual std::uint64_t seq_length() const = 0;
  // The next sample of the global order (cheap: no tokens are read).
  virtual SampleRef next() = 0;
  virtual void read(const SampleRef& ref, std::uint32_t* out) const = 0;
  virtual std::uint64_t consumed_samples() const = 0;
  // A small JSON object; restore() of it continues exactly where state() was taken, and
  // throws keel::Error when it belongs to another configuration.
  virtual nlohmann::json state() const = 0;
  virtual void restore(const nlohmann::json& state) = 0;
};

// One dataset: global samples 0, 1, 2, ... of its SequenceSampler.
// State: {"kind": "single", "seed", "seq_length", "samples_per_epoch", "consumed_samples", "epoch", "index"}.
class SingleStream : public SampleStream {
 public:
  explicit SingleStream(const SequenceSampler& sampler) : sampler_(sampler) {}
  std::uint64_t seq_length() const override { return sampler_.seq_length(); }
  SampleRef next() override { return {0, consumed_++}; }
  void read(const SampleRef& ref, std::uint32_t* out) const override { sampler_.sample(ref.index, out); }
  std::uint64_t consumed_samples() const override { return consumed_; }
  nlohmann::json state() const override;
  void restore(const nlohmann::json& state) override;

 private:
  const SequenceSampler& sampler_;
  std::uint64_t consumed_ = 0;
};

// The batches of one rank. Every rank walks the whole global order (cheap) and reads only its
// own samples.
class BatchLoader {
 public:
  // Throws keel::UsageError unless world divides global_batch and 0 <= rank < world.
  BatchLoader(SampleStream& stream, std::uint64_t global_batch, int rank = 0, int world = 1);
  std::uint64_t micro_rows() const { return global_batch_ / static_cast<std::uint64_t>(world_); }
  std::uint64_t row_tokens() const { return stream_.seq_length() + 1; }
  // This rank's part of the next global batch: micro_rows() rows of seq_length + 1 tokens.
  std::vector<std::uint32_t> next_batch(std::vector<SampleRef>* refs = nullptr);
  // The stream's state, taken between global batches.
  nlohmann::json state() const { return stream_.state(); }
  void restore(const nlohmann::json& state) { stream_.restore(state); }

 private:
  SampleStream& stream_;
  std::uint64_t global_batch_;
  int rank_, world_;
};

// State files: JSON text written atomically.
void save_state(const std::string& path, const nlohmann::json& state);
nlohmann::json load_state(const std::string& path);

}  // namespace keel::data

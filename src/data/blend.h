// Weighted blends of several datasets, in phases (docs/data.md, "Blends and phases").
//
// A data config (YAML):
//
//   seq_length: 1024
//   seed: 1234
//   shuffle: true                  # optional, default true
//   datasets:                      # name: PREFIX (relative to the YAML file's directory)
//     web: corpus/web
//     code: corpus/code
//   phases:                        # in order; each but the last needs `tokens`
//     - name: warmup               # optional
//       tokens: 2B                 # length of the phase (K, M, B/G, T: powers of 1000)
//       weights: {web: 0.7, code: 0.3}
//     - weights: {web: 0.5, code: 0.5}   # the last phase runs to the end of training
//
// Phase p covers global samples [E(p-1), E(p)) with E(p) = ceil(tokens of phases 0..p / L): it
// ends at the first sample boundary at or after its token budget (samples count L tokens, the
// label token being the next sample's first input). Inside a phase, sample c goes to the dataset
// d with the largest w_d * (c + 1) - n_d (n_d: samples dataset d got in this phase; ties to the
// lower index), Megatron's error-minimizing greedy blend: every prefix of the phase gives each
// dataset its weighted share to within one sample. Each dataset hands out its own global sample
// order (sampler.h, seeded from the run's seed and the dataset's position), continuing across
// phases.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "data/indexed_dataset.h"
#include "data/sampler.h"

namespace YAML {
class Node;
}

namespace keel::data {

struct PhaseConfig {
  std::string name;
  std::uint64_t tokens = 0;    // 0: to the end (the last phase only)
  std::vector<double> weights;  // per dataset, normalized to sum 1
};

struct DataConfig {
  std::uint64_t seq_length = 0;
  std::uint64_t seed = 1234;
  bool shuffle = true;
  std::vector<std::string> names, prefixes;
  std::vector<PhaseConfig> phases;
};

// Parses a data config; every error is one keel::Error line naming `what` (the file), the key
// and its line: unknown keys, missing keys, unknown dataset names, bad weights or token counts.
DataConfig parse_data_config(const std::string& yaml_text, const std::string& what, const std::string& base_dir);
// The same from a parsed mapping (a train config's `data:`, whose lines the errors keep);
// default_phase: without `phases`, one phase weighting every dataset alike.
DataConfig parse_data_config(const YAML::Node& root, const std::string& what, const std::string& base_dir,
                             bool default_phase);
DataConfig load_data_config(const std::string& path);

// Decimal token counts: 1000, 500K, 300M, 2B (= 2G), 1.5T.
std::uint64_t parse_token_count(const std::string& text);

class BlendStream : public SampleStream {
 public:
  // One sampler per dataset, in the config's order.
  BlendStream(std::vector<const SequenceSampler*> samplers, std::vector<PhaseConfig> phases);
  std::uint64_t seq_length() const override { return seq_length_; }
  SampleRef next() override;
  void read(const SampleRef& ref, std::uint32_t* out) const override { samplers_.at(ref.source)->sample(ref.index, out); }
  std::uint64_t consumed_samples() const override { return consumed_; }
  std::size_t phase() const { return phase_; }
  // First global sample of phase p (phase_start(phases) is "never").
  std::uint64_t phase_start(std::size_t p) const { return p == 0 ? 0 : phase_end_[p - 1]; }
  // State: {"kind": "blend", "seed", "seq_length", "datasets", "consumed_samples", "phase",
  //         "phase_samples", "phase_counts": [...], "drawn": [...] (next sample of each dataset)}.
  nlohmann::json state() const override;
  void restore(const nlohmann::json& state) override;
  // Samples per epoch of each dataset (its size at this seq_length), in the config's order.
  std::vector<std::uint64_t> samples_per_epoch() const;

 private:
  std::vector<const SequenceSampler*> samplers_;
  std::vector<PhaseConfig> phases_;
  std::vector<std::uint64_t> phase_end_;  // exclusive end sample of each phase (UINT64_MAX: last)
  std::uint64_t seq_length_ = 0;
  std::uint64_t consumed_ = 0, in_phase_ = 0;
  std::size_t phase_ = 0;
  std::vector<std::uint64_t> counts_, drawn_;
};

// Everything a config describes, opened: datasets, their samplers and the blend.
class DataPipeline {
 public:
  explicit DataPipeline(const DataConfig& config);
  SampleStream& stream() { return *stream_; }
  const DataConfig& config() const { return config_; }
  const IndexedDataset& dataset(std::size_t i) const { return *datasets_.at(i); }

 private:
  DataConfig config_;
  std::vector<std::unique_ptr<IndexedDataset>> datasets_;
  std::vector<std::unique_ptr<SequenceSampler>> samplers_;
  std::unique_ptr<SampleStream> stream_;
};

}  // namespace keel::data

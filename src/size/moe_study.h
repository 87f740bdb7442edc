// The MoE width study: for candidate (experts, top-k, expert width) at a fixed total or
// active expert budget, predicted training throughput (expert GEMMs at the resulting tokens
// per expert) against decode latency (bytes per step over HBM bandwidth) at batch 1..N.
#pragma once

#include <string>
#include <vector>

#include "size/estimate.h"

namespace keel::size {

struct MoeStudyOptions {
  std::string budget = "active";  // "active": top_k x width fixed; "total": experts x width fixed
  std::vector<int> experts = {8, 16, 32, 64};
  std::vector<int> top_k = {1, 2, 4};
};

struct MoeCandidate {
  int experts = 0, top_k = 0, expert_hidden = 0;
  bool current = false;  // the configured model
  double total_params = 0, active_params = 0;  // non-embedding
  std::int64_t tokens_per_expert = 0;
  double expert_gemm_efficiency = 0;  // up/gate forward, of peak
  double predicted_mfu = 0, train_tokens_per_s_per_gpu = 0;
  double memory_bytes = 0;            // per GPU for the layout
  std::vector<DecodePoint> decode;    // at Setup::decode_batches, context Setup::seq
};

struct MoeStudy {
  MoeStudyOptions options;
  std::vector<MoeCandidate> rows;
  std::vector<std::string> skipped;  // candidates the layout cannot hold, with why
};

MoeStudy run_moe_study(const Setup& s, const MoeStudyOptions& o);
// One PNG: decode latency (ms per token) against batch, one curve per candidate, labelled
// with its predicted training throughput.
void plot_moe_study(const Setup& s, const MoeStudy& study, const std::string& path);

}  // namespace keel::size

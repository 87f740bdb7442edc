#include "size/moe_study.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "common/plot.h"

namespace keel::size {

MoeStudy run_moe_study(const Setup& s, const MoeStudyOptions& o) {
  const model::ModelConfig& base = s.model;
  if (base.experts == 0) throw UsageError("--moe-study needs an MoE model (experts > 0)");
  if (o.budget != "active" && o.budget != "total")
    throw UsageError(fmt::format("--moe-budget must be active or total (got '{}')", o.budget));
  MoeStudy study;
  study.options = o;
  const double budget = o.budget == "active" ? static_cast<double>(base.top_k) * base.expert_hidden
                                             : static_cast<double>(base.experts) * base.expert_hidden;
  const hw::GemmModel gm(s.hardware.profile, s.hardware.gemm_profile);
  std::vector<std::tuple<int, int>> grid;
  for (int e : o.experts)
    for (int k : o.top_k) grid.push_back({e, k});
  if (std::find(grid.begin(), grid.end(), std::tuple<int, int>{base.experts, base.top_k}) == grid.end())
    grid.push_back({base.experts, base.top_k});
  for (const auto& [e, k] : grid) {
    if (k > e || e <= 0 || k <= 0) continue;
    model::ModelConfig m = base;
    m.experts = e;
    m.top_k = k;
    const double w = o.budget == "active" ? budget / k : budget / e;
    m.expert_hidden = std::max(128, static_cast<int>(std::lround(w / 128)) * 128);
    const bool current = e == base.experts && k == base.top_k;
    if (current) m.expert_hidden = base.expert_hidden;
    if (m.router_skip_expert && k != 1) m.router_skip_expert = false;  // ZAYA1's skip class is top-1 only
    Setup cs = s;
    cs.model = m;
    model::ParamCounts pc;
    try {
      model::validate(m);
      check_layout(cs.layout, m);
      pc = model::count_params(m);  // a candidate whose count overflows is skipped with the reason
    } catch (const UsageError& err) {
      study.skipped.push_back(fmt::format("experts {} top-{}: {}", e, k, err.what()));
      continue;
    }
    MoeCandidate c;
    c.experts = e, c.top_k = k, c.expert_hidden = m.expert_hidden, c.current = current;
    c.total_params = static_cast<double>(pc.total_non_embedding);
    c.active_params = static_cast<double>(pc.active_non_embedding);
    const StepEstimate st = estimate_step(cs);
    c.tokens_per_expert = tokens_per_local_expert(st.tokens_per_gpu_microbatch, cs.layout.ep, k, e);
    c.expert_gemm_efficiency =
        gm.predict({c.tokens_per_expert, 2LL * m.expert_hidden, m.hidden, e / cs.layout.ep}).efficiency;
    c.predicted_mfu = st.predicted_mfu;
    c.train_tokens_per_s_per_gpu =
        st.predicted_mfu * s.hardware.profile.bf16_tflops * 1e12 / model::token_flops(m, s.seq).training();
    c.memory_bytes = estimate_memory(cs).total();
    for (int b : s.decode_batches) c.decode.push_back(decode_step(m, s.hardware, b, s.seq));
    study.rows.push_back(c);
  }
  std::sort(study.rows.begin(), study.rows.end(), [](const MoeCandidate& a, const MoeCandidate& b) {
    return std::tie(a.experts, a.top_k) < std::tie(b.experts, b.top_k);
  });
  return study;
}

void plot_moe_study(const Setup& s, const MoeStudy& study, const std::string& path) {
  plot::Chart chart;
  chart.title = fmt::format("{}: MoE width study ({} budget) on {}: decode latency vs batch", s.model.name,
                            study.options.budget, s.hardware.profile.name);
  chart.x_label = fmt::format("decode batch (sequences of {} tokens)", s.seq);
  chart.y_label = "ms per decode step (HBM-bound)";
  chart.log_x = true;
  chart.log_y = true;
  for (const auto& c : study.rows) {
    plot::Series ser;
    ser.label = fmt::format("E{} k{} w{}{}: train {:.0f}K tok/s/GPU", c.experts, c.top_k, c.expert_hidden,
                            c.current ? " (config)" : "", c.train_tokens_per_s_per_gpu / 1e3);
    for (const auto& d : c.decode) {
      ser.x.push_back(d.batch);
      ser.y.push_back(d.ms_per_token());
    }
    chart.series.push_back(std::move(ser));
  }
  plot::write_png(chart, path);
}

}  // namespace keel::size

#include "size/report.h"

#include <fmt/format.h>

#include <cmath>

#include "common/error.h"

namespace keel::size {

std::string human_count(double x) {
  const double a = std::fabs(x);
  if (a >= 1e12) return fmt::format("{:.2f}T", x / 1e12);
  if (a >= 1e9) return fmt::format("{:.2f}B", x / 1e9);
  if (a >= 1e6) return fmt::format("{:.1f}M", x / 1e6);
  if (a >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{:.0f}", x);
}

std::string human_bytes(double b) {
  const double gib = 1024.0 * 1024 * 1024;
  if (b >= gib) return fmt::format("{:.2f} GiB", b / gib);
  if (b >= 1024 * 1024) return fmt::format("{:.1f} MiB", b / (1024 * 1024));
  if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024);
  return fmt::format("{:.0f} B", b);
}

std::string human_duration(double s) {
  if (s >= 2 * 86400) return fmt::format("{:.1f} days", s / 86400);
  if (s >= 2 * 3600) return fmt::format("{:.1f} h", s / 3600);
  if (s >= 120) return fmt::format("{:.1f} min", s / 60);
  return fmt::format("{:.1f} s", s);
}

namespace {

// The estimates are doubles built from integer counts: a size past what they can hold shows
// as inf, NaN or a negative number. Refuse to print such a report (it would read as a result).
void require_finite(double value, const std::string& what, const Setup& s) {
  if (std::isfinite(value) && value >= 0) return;
  throw UsageError(fmt::format("model '{}': the {} estimate is {} (check the config's sizes, the flags and the "
                               "hardware figures)",
                               s.model.name, what, value));
}

void require_finite_estimates(const SizeReport& r) {
  const Setup& s = r.setup;
  require_finite(r.flops.training(), "FLOPs per token", s);
  require_finite(r.flops.training_with(model::Recompute::kFull), "FLOPs per token with recomputation", s);
  for (const auto& i : r.memory.items) require_finite(i.bytes, "memory (" + i.name + ")", s);
  require_finite(r.memory.total(), "memory per GPU", s);
  require_finite(r.memory.ep_worst_case_extra, "expert-parallel worst-case memory", s);
  require_finite(r.decode.kv_bytes_per_token + r.decode.fixed_bytes_per_sequence, "decode state", s);
  for (const auto& d : r.decode_points) require_finite(d.seconds, fmt::format("decode step at batch {}", d.batch), s);
  require_finite(r.step.gemm_seconds, "GEMM time per step", s);
  require_finite(r.step.optimizer.seconds, "Muon time per step", s);
  require_finite(r.step.predicted_mfu, "predicted MFU", s);
  require_finite(r.train.seconds_at_mfu, "time to train", s);
  require_finite(r.train.seconds_predicted, "predicted time to train", s);
}

// Sequence parallelism, where tensor parallelism makes it a choice; the context mode where
// context parallelism does (but the default all-gather).
std::string layout_note(const Setup& s) {
  std::string note;
  if (s.layout.tp >= 2) note = s.sequence_parallel ? ", sequence parallel" : ", no sequence parallelism";
  if (s.layout.cp >= 2 && s.context_mode != parallel::ContextMode::kAllGather)
    note += fmt::format(", context mode {}", parallel::context_mode_name(s.context_mode));
  return note;
}

}  // namespace

SizeReport build_report(const std::string& config_path, const Setup& s, const MoeStudyOptions* moe) {
  SizeReport r;
  r.config_path = config_path;
  r.setup = s;
  r.params = model::count_params(s.model);
  r.flops = model::token_flops(s.model, s.seq);
  r.memory = estimate_memory(s);
  r.decode = decode_state(s.model);
  for (int b : s.decode_batches) r.decode_points.push_back(decode_step(s.model, s.hardware, b, s.seq));
  r.step = estimate_step(s);
  r.train = estimate_train_time(s, r.flops, r.step);
  require_finite_estimates(r);
  r.findings = check_sizing(s);
  if (moe) r.moe = run_moe_study(s, *moe);
  return r;
}

void print_report(const SizeReport& r, std::FILE* out, bool show_gemms) {
  const Setup& s = r.setup;
  const auto& m = s.model;
  const auto& hw = s.hardware.profile;
  auto line = [&](const std::string& text) { std::fprintf(out, "%s\n", text.c_str()); };

  line(fmt::format("# keel size  |  {} ({})  |  {}", m.name, r.config_path, hw.description));
  for (const auto& src : s.hardware.sources) line("#   hardware: " + src);
  line(fmt::format("#   peak bf16 {:.0f} TFLOP/s dense, HBM {:.2f} TB/s, {:.0f} GiB, {} SMs/CUs, link {:.0f} GB/s",
                   hw.bf16_tflops, hw.hbm_tbps, hw.hbm_gib, hw.sm_count, hw.link_gbps));
  line(fmt::format("#   layout {} on {} GPUs, seq {}, micro-batch {}, {} micro-batches/step, recompute {}, {}{}",
                   s.layout.str(), s.layout.world(), s.seq, s.micro_batch, s.micro_batches,
                   model::recompute_name(s.recompute), s.optimizer == Optimizer::kMuon ? "Muon" : "AdamW",
                   layout_note(s)));

  // Parameters.
  const auto& p = r.params;
  line("\n## Parameters");
  line(fmt::format("{:<22} {:>12} {:>12} {:>12}", "component", "total", "active", "per layer"));
  for (const auto& c : p.components)
    line(fmt::format("{:<22} {:>12} {:>12} {:>12}", c.name, human_count(c.total), human_count(c.active),
                     c.per_layer ? human_count(c.per_layer) : "-"));
  line(fmt::format("{:<22} {:>12} {:>12}", "non-embedding", human_count(p.total_non_embedding),
                   human_count(p.active_non_embedding)));
  line(fmt::format("{:<22} {:>12} {:>12}{}", "with embeddings", human_count(p.total), human_count(p.active),
                   m.tied_embeddings ? "   (tied: the LM head shares the embedding)" : ""));
  line(fmt::format("exact: total {} / active {} (non-embedding {} / {})", p.total, p.active, p.total_non_embedding,
                   p.active_non_embedding));

  // FLOPs.
  const auto& f = r.flops;
  line(fmt::format("\n## FLOPs per token (seq {})", f.seq));
  line("convention: 2 FLOPs per multiply-add; backward = 2 x forward; attention causal-halved (llm.c 6N + 6LCT);");
  line("MFU = model FLOPs (no recompute) / (time x dense bf16 peak); recomputation counts only in HFU.");
  line(fmt::format("{:<22} {:>12} {:>12} {:>7}", "item", "forward", "training", "share"));
  for (const auto& it : f.items)
    line(fmt::format("{:<22} {:>12.4g} {:>12.4g} {:>6.1f}%", it.name, it.forward, 3 * it.forward,
                     100 * it.forward / f.forward()));
  line(fmt::format("{:<22} {:>12.4g} {:>12.4g}", "total", f.forward(), f.training()));
  line(fmt::format("backward {:.4g}; training 6N+attention {:.4g} (PaLM non-halved attention: {:.4g})", f.backward(),
                   f.training(), f.training_palm()));
  line(fmt::format("with recomputation (HFU numerator): none {:.4g}, selective {:.4g}, full {:.4g}",
                   f.training_with(model::Recompute::kNone), f.training_with(model::Recompute::kSelective),
                   f.training_with(model::Recompute::kFull)));

  // Memory.
  const auto& mem = r.memory;
  line(fmt::format("\n## Memory per GPU ({}{}; heaviest pipeline stage: {})", s.layout.str(), layout_note(s), mem.stage));
  line(fmt::format("parameters on this GPU: {} (ZeRO-{} shards {} over dp*cp = {}, experts over dp*cp/ep = {})",
                   human_count(mem.params_on_gpu), s.layout.zero,
                   s.layout.zero == 0 ? "nothing" : s.layout.zero == 1 ? "optimizer states" : s.layout.zero == 2 ? "optimizer states and gradients" : "optimizer states, gradients and weights",
                   s.layout.dp * s.layout.cp, s.layout.dp * s.layout.cp / s.layout.ep));
  if (mem.keel_train_optimizer_floats > 0 && s.layout.dp * s.layout.cp > 1)
    line(fmt::format("keel train's ZeRO-1 cuts (whole Muon matrices, work balanced against floats): the busiest "
                     "rank's optimizer shard is {} floats, {:+.1f}% on the mean",
                     human_count(mem.keel_train_optimizer_floats),
                     100 * (mem.keel_train_optimizer_floats / mem.keel_train_optimizer_floats_mean - 1)));
  for (const auto& it : mem.items) line(fmt::format("  {:<48} {:>12}", it.name, human_bytes(it.bytes)));
  const double cap = hw.hbm_gib * 1024 * 1024 * 1024;
  line(fmt::format("  {:<48} {:>12}  of {:.0f} GiB: {}", "total", human_bytes(mem.total()), hw.hbm_gib,
                   mem.total() <= cap * 0.9 ? "fits" : mem.total() <= cap ? "tight (over 90%)" : "DOES NOT FIT"));
  if (mem.ep_worst_case_extra > 0) {
    const double worst = mem.total() + mem.ep_worst_case_extra;
    line(fmt::format("  dropless expert parallelism, worst case (every token of the ep group picks this GPU's experts):"
                     "\n    +{} ({}x its routed rows) = {} of {:.0f} GiB: {}",
                     human_bytes(mem.ep_worst_case_extra), s.layout.ep, human_bytes(worst), hw.hbm_gib,
                     worst <= cap * 0.9 ? "fits" : worst <= cap ? "tight (over 90%)" : "DOES NOT FIT"));
  }
  line(fmt::format("  activations by recompute: none {}, selective {}, full {} ({:.0f} / {:.0f} / {:.0f} B per token per layer)",
                   human_bytes(mem.activations_none), human_bytes(mem.activations_selective),
                   human_bytes(mem.activations_full), mem.activation_bytes_per_token_layer[0],
                   mem.activation_bytes_per_token_layer[1], mem.activation_bytes_per_token_layer[2]));
  line(fmt::format("inference: KV {} per token ({:.0f} B), fixed state {} per sequence; at context {}:",
                   human_bytes(r.decode.kv_bytes_per_token), r.decode.kv_bytes_per_token,
                   human_bytes(r.decode.fixed_bytes_per_sequence), s.seq));
  for (const auto& d : r.decode_points)
    line(fmt::format("  decode batch {:>4}: {} read per step, {:.3f} ms/token, {:.0f} tokens/s (HBM-bound, one GPU)",
                     d.batch, human_bytes(d.bytes), d.ms_per_token(), d.tokens_per_s()));

  // Time.
  const auto& st = r.step;
  const auto& t = r.train;
  line("\n## Training time");
  line(fmt::format("model FLOPs per token {:.4g}; at the assumed MFU {:.0f}%: {:.0f} tokens/s/GPU", t.flops_per_token,
                   100 * s.mfu, t.tokens_per_s_per_gpu_at_mfu));
  line(fmt::format("GEMM-predicted ({}): {:.1f}% MFU ceiling, {:.0f} tokens/s/GPU", s.hardware.gemm_profile.empty() ? "analytic tile/wave model" : "measured GEMM profile",
                   100 * st.predicted_mfu, t.tokens_per_s_per_gpu_predicted));
  line(fmt::format("  per micro-batch per GPU: {} tokens, GEMMs {:.2f} ms + attention {:.2f} ms, pipeline bubble {:.1f}%; "
                   "no communication or elementwise time: an upper bound",
                   st.tokens_per_gpu_microbatch, 1e3 * (st.gemm_seconds - st.attention_seconds),
                   1e3 * st.attention_seconds, 100 * st.bubble));
  if (s.optimizer == Optimizer::kMuon)
    line(fmt::format("  Muon's Newton-Schulz per optimizer step ({} tokens: micro-batches {} x dp {}): {:.3g} TFLOP "
                     "whole model, {:.3g} TFLOP and {:.2f} ms {}, {:.1f}% of the predicted step{}",
                     human_count(static_cast<double>(st.tokens_per_step)), s.micro_batches, s.layout.dp,
                     st.optimizer.flops_total * 1e-12, st.optimizer.flops_per_gpu * 1e-12, 1e3 * st.optimizer.seconds,
                     mem.keel_train_optimizer_floats > 0 ? "on the busiest GPU (keel train's ZeRO-1 cuts)" : "per GPU",
                     100 * st.optimizer.seconds / st.step_seconds,
                     st.optimizer.seconds > 0.1 * st.step_seconds ? " (more micro-batches per step amortize it)" : ""));
  if (s.tokens > 0)
    line(fmt::format("{} tokens on {} GPUs: {} at {:.0f}% MFU; {} at the predicted {:.1f}%", human_count(s.tokens),
                     s.layout.world(), human_duration(t.seconds_at_mfu), 100 * s.mfu, human_duration(t.seconds_predicted),
                     100 * st.predicted_mfu));
  else
    line("(give --train-tokens N to get the time to train N tokens)");
  if (show_gemms) {
    line(fmt::format("  {:<16} {:<10} {:>8} {:>8} {:>8} {:>5} {:>7} {:>6} {:>6} {:>8}", "gemm", "pass", "m", "n", "k",
                     "batch", "layers", "waves", "wave%", "TFLOP/s"));
    for (const auto& g : st.gemms)
      line(fmt::format("  {:<16} {:<10} {:>8} {:>8} {:>8} {:>5} {:>7.2f} {:>6} {:>5.0f}% {:>8.1f}", g.gemm.name,
                       g.gemm.pass, g.gemm.m, g.gemm.n, g.gemm.k, g.gemm.batch, g.layers * g.repeats,
                       g.prediction.waves, 100 * g.prediction.wave_efficiency, g.prediction.tflops));
  }

  // Findings.
  line("\n## Sizing findings");
  for (const auto& fd : r.findings) {
    line(fmt::format("[{}] {:<9} {}", fd.severity, fd.rule, fd.message));
    if (!fd.fix.empty()) line(fmt::format("       fix: {}", fd.fix));
  }

  if (r.moe) {
    line(fmt::format("\n## MoE width study ({} budget: {} fixed)", r.moe->options.budget,
                     r.moe->options.budget == "active" ? "top_k x expert_hidden" : "experts x expert_hidden"));
    std::string head = fmt::format("{:>7} {:>5} {:>7} {:>9} {:>9} {:>8} {:>6} {:>6} {:>11} {:>10}", "experts", "top_k",
                                   "width", "total", "active", "tok/exp", "eGEMM", "MFU", "train tok/s", "mem/GPU");
    for (int b : s.decode_batches) head += fmt::format(" {:>9}", fmt::format("ms@b{}", b));
    line(head);
    for (const auto& c : r.moe->rows) {
      std::string row = fmt::format("{:>7} {:>5} {:>7} {:>9} {:>9} {:>8} {:>5.0f}% {:>5.1f}% {:>11.0f} {:>10}{}",
                                    c.experts, c.top_k, c.expert_hidden, human_count(c.total_params),
                                    human_count(c.active_params), c.tokens_per_expert, 100 * c.expert_gemm_efficiency,
                                    100 * c.predicted_mfu, c.train_tokens_per_s_per_gpu, human_bytes(c.memory_bytes), "");
      for (const auto& d : c.decode) row += fmt::format(" {:>9.3f}", d.ms_per_token());
      if (c.current) row += "  <- config";
      line(row);
    }
    for (const auto& sk : r.moe->skipped) line("  skipped: " + sk);
  }
  std::fflush(out);
}

nlohmann::json report_json(const SizeReport& r) {
  using nlohmann::json;
  const Setup& s = r.setup;
  const auto& m = s.model;
  const auto& hw = s.hardware.profile;
  json j;
  j["schema"] = kSizeJsonSchema;
  j["keel_version"] = KEEL_VERSION;
  j["command"] = "size";
  j["config"] = {{"path", r.config_path},
                 {"name", m.name},
                 {"vocab_size", m.vocab_size},
                 {"hidden", m.hidden},
                 {"layers", m.layers},
                 {"attention", model::attention_kind_name(m.attention)},
                 {"heads", m.heads},
                 {"kv_heads", m.kv_heads},
                 {"head_dim", m.head_dim},
                 {"ffn_hidden", m.ffn_hidden},
                 {"experts", m.experts},
                 {"top_k", m.top_k},
                 {"expert_hidden", m.expert_hidden},
                 {"tied_embeddings", m.tied_embeddings}};
  j["hardware"] = {{"name", hw.name},
                   {"description", hw.description},
                   {"bf16_tflops", hw.bf16_tflops},
                   {"fp8_tflops", hw.fp8_tflops},
                   {"hbm_tbps", hw.hbm_tbps},
                   {"hbm_gib", hw.hbm_gib},
                   {"sm_count", hw.sm_count},
                   {"link_gbps", hw.link_gbps},
                   {"measured_hbm_tbps", s.hardware.measured_hbm_tbps},
                   {"measured_busbw_gbps", s.hardware.measured_busbw_gbps},
                   {"gemm_profile_shapes", s.hardware.gemm_profile.size()},
                   {"sources", s.hardware.sources}};
  const auto& l = s.layout;
  j["layout"] = {{"gpus", l.world()}, {"dp", l.dp}, {"tp", l.tp}, {"ep", l.ep}, {"pp", l.pp},
                 {"cp", l.cp},       {"tsp", l.tsp}, {"zero", l.zero}, {"sequence_parallel", l.tp > 1 && s.sequence_parallel}};
  j["run"] = {{"seq", s.seq},
              {"micro_batch", s.micro_batch},
              {"micro_batches", s.micro_batches},
              {"recompute", model::recompute_name(s.recompute)},
              {"optimizer", s.optimizer == Optimizer::kMuon ? "muon" : "adamw"},
              {"grad_reduce", s.grad_reduce_bf16 ? "bf16" : "fp32"}};

  json comps = json::array();
  for (const auto& c : r.params.components)
    comps.push_back({{"name", c.name}, {"total", c.total}, {"active", c.active}, {"per_layer", c.per_layer},
                     {"embedding", c.embedding}, {"expert", c.expert}});
  j["params"] = {{"total", r.params.total},
                 {"active", r.params.active},
                 {"total_non_embedding", r.params.total_non_embedding},
                 {"active_non_embedding", r.params.active_non_embedding},
                 {"matmul_active", r.params.matmul_active},
                 {"components", comps}};

  const auto& f = r.flops;
  json items = json::array();
  for (const auto& it : f.items) items.push_back({{"name", it.name}, {"forward", it.forward}, {"training", 3 * it.forward}});
  j["flops"] = {{"convention", "2 FLOPs per multiply-add; backward = 2 x forward; attention causal-halved (llm.c: 6N + "
                               "6*L*C*T); MFU = model FLOPs without recomputation / (time x dense bf16 peak)"},
                {"seq", f.seq},
                {"forward", f.forward()},
                {"backward", f.backward()},
                {"training", f.training()},
                {"training_palm", f.training_palm()},
                {"attention_forward", f.attention_forward},
                {"lm_head_forward", f.lm_head_forward},
                {"training_with_recompute",
                 {{"none", f.training_with(model::Recompute::kNone)},
                  {"selective", f.training_with(model::Recompute::kSelective)},
                  {"full", f.training_with(model::Recompute::kFull)}}},
                {"items", items}};

  json mitems = json::array();
  for (const auto& it : r.memory.items) mitems.push_back({{"name", it.name}, {"bytes", it.bytes}});
  j["memory"] = {{"stage", r.memory.stage},
                 {"params_on_gpu", r.memory.params_on_gpu},
                 {"items", mitems},
                 {"total_bytes", r.memory.total()},
                 {"ep_worst_case_extra_bytes", r.memory.ep_worst_case_extra},
                 {"keel_train_optimizer_floats", r.memory.keel_train_optimizer_floats},
                 {"keel_train_optimizer_floats_mean", r.memory.keel_train_optimizer_floats_mean},
                 {"capacity_bytes", hw.hbm_gib * 1024 * 1024 * 1024},
                 {"fits", r.memory.total() <= hw.hbm_gib * 1024 * 1024 * 1024},
                 {"fits_ep_worst_case",
                  r.memory.total() + r.memory.ep_worst_case_extra <= hw.hbm_gib * 1024 * 1024 * 1024},
                 {"activations_by_recompute",
                  {{"none", r.memory.activations_none},
                   {"selective", r.memory.activations_selective},
                   {"full", r.memory.activations_full}}},
                 {"activation_bytes_per_token_layer",
                  {{"none", r.memory.activation_bytes_per_token_layer[0]},
                   {"selective", r.memory.activation_bytes_per_token_layer[1]},
                   {"full", r.memory.activation_bytes_per_token_layer[2]}}}};

  json points = json::array();
  for (const auto& d : r.decode_points)
    points.push_back({{"batch", d.batch}, {"bytes", d.bytes}, {"ms_per_token", d.ms_per_token()}, {"tokens_per_s", d.tokens_per_s()}});
  j["inference"] = {{"kv_bytes_per_token", r.decode.kv_bytes_per_token},
                    {"fixed_bytes_per_sequence", r.decode.fixed_bytes_per_sequence},
                    {"context", s.seq},
                    {"decode", points}};

  json gemms = json::array();
  for (const auto& g : r.step.gemms)
    gemms.push_back({{"name", g.gemm.name},
                     {"pass", g.gemm.pass},
                     {"m", g.gemm.m},
                     {"n", g.gemm.n},
                     {"k", g.gemm.k},
                     {"batch", g.gemm.batch},
                     {"layers", g.layers * g.repeats},
                     {"tflops", g.prediction.tflops},
                     {"efficiency", g.prediction.efficiency},
                     {"tile", fmt::format("{}x{}", g.prediction.tile_m, g.prediction.tile_n)},
                     {"waves", g.prediction.waves},
                     {"wave_efficiency", g.prediction.wave_efficiency},
                     {"source", g.prediction.source}});
  j["step"] = {{"tokens_per_gpu_microbatch", r.step.tokens_per_gpu_microbatch},
               {"gemm_seconds", r.step.gemm_seconds},
               {"attention_seconds", r.step.attention_seconds},
               {"model_flops_per_gpu", r.step.model_flops_per_gpu},
               {"pipeline_bubble", r.step.bubble},
               {"tokens_per_step", r.step.tokens_per_step},
               {"optimizer_flops_total", r.step.optimizer.flops_total},
               {"optimizer_flops_per_gpu", r.step.optimizer.flops_per_gpu},
               {"optimizer_seconds", r.step.optimizer.seconds},
               {"step_seconds", r.step.step_seconds},
               {"predicted_mfu", r.step.predicted_mfu},
               {"gemms", gemms}};
  j["training"] = {{"tokens", s.tokens},
                   {"gpus", l.world()},
                   {"flops_per_token", r.train.flops_per_token},
                   {"mfu_assumed", s.mfu},
                   {"tokens_per_s_per_gpu_at_mfu", r.train.tokens_per_s_per_gpu_at_mfu},
                   {"seconds_at_mfu", r.train.seconds_at_mfu},
                   {"mfu_predicted", r.step.predicted_mfu},
                   {"tokens_per_s_per_gpu_predicted", r.train.tokens_per_s_per_gpu_predicted},
                   {"seconds_predicted", r.train.seconds_predicted}};
  json findings = json::array();
  for (const auto& fd : r.findings)
    findings.push_back({{"rule", fd.rule}, {"where", fd.where}, {"severity", fd.severity}, {"message", fd.message},
                        {"fix", fd.fix}, {"predicted_gain", fd.predicted_gain}});
  j["findings"] = findings;
  if (r.moe) {
    json rows = json::array();
    for (const auto& c : r.moe->rows) {
      json dec = json::array();
      for (const auto& d : c.decode) dec.push_back({{"batch", d.batch}, {"ms_per_token", d.ms_per_token()}, {"bytes", d.bytes}});
      rows.push_back({{"experts", c.experts},
                      {"top_k", c.top_k},
                      {"expert_hidden", c.expert_hidden},
                      {"current", c.current},
                      {"total_non_embedding", c.total_params},
                      {"active_non_embedding", c.active_params},
                      {"tokens_per_expert", c.tokens_per_expert},
                      {"expert_gemm_efficiency", c.expert_gemm_efficiency},
                      {"predicted_mfu", c.predicted_mfu},
                      {"train_tokens_per_s_per_gpu", c.train_tokens_per_s_per_gpu},
                      {"memory_bytes", c.memory_bytes},
                      {"decode", dec}});
    }
    j["moe_study"] = {{"budget", r.moe->options.budget}, {"rows", rows}, {"skipped", r.moe->skipped}};
  }
  return j;
}

}  // namespace keel::size

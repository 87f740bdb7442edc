#include "size/rules.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <numeric>

#include <fmt/format.h>

#include "common/error.h"

namespace keel::size {
namespace {

double pct(double x) { return 100 * x; }

std::int64_t round_to(std::int64_t x, std::int64_t q) { return std::max(q, (x + q / 2) / q * q); }

// ceil(a / b) for a >= 0, b > 0, without a + b - 1 overflowing.
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Largest power of two dividing x.
std::int64_t pow2_factor(std::int64_t x) { return x > 0 ? (x & -x) : 0; }

// The config key a GEMM dimension comes from (what the user would change).
std::string weight_key(const std::string& gemm, bool output_dim) {
  if (gemm == "lm_head") return output_dim ? "vocab_size" : "hidden";
  if (gemm == "mlp_up_gate") return output_dim ? "ffn_hidden" : "hidden";
  if (gemm == "mlp_down") return output_dim ? "hidden" : "ffn_hidden";
  if (gemm == "expert_up_gate" || gemm == "shared_up_gate") return output_dim ? "expert_hidden" : "hidden";
  if (gemm == "expert_down" || gemm == "shared_down") return output_dim ? "hidden" : "expert_hidden";
  if (gemm == "router" || gemm == "router_out") return output_dim ? "experts (+ skip class)" : "router_hidden";
  if (gemm.rfind("router", 0) == 0) return output_dim ? "router_hidden" : "hidden";
  if (gemm == "attn_out" || gemm == "linear_out") return output_dim ? "hidden" : "heads x head_dim";
  return output_dim ? "heads/kv_heads x head_dim" : "hidden";
}

double gemm_tflops(const hw::GemmModel& gm, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t b) {
  return gm.predict({m, n, k, b}).tflops;
}

}  // namespace

WidthChoice mlp_throughput(const hw::GemmModel& gm, std::int64_t t, int h, std::int64_t w, std::int64_t batch) {
  // SwiGLU: up|gate [t x h] x [h x 2w], down [t x w] x [w x h], forward and both backward GEMMs.
  const hw::GemmShape shapes[] = {{t, 2LL * w, h, batch}, {t, h, 2LL * w, batch}, {h, 2LL * w, t, batch},
                                  {t, h, w, batch},       {t, w, h, batch},       {w, h, t, batch}};
  double flops = 0, secs = 0;
  for (const auto& s : shapes) {
    flops += 2.0 * s.m * s.n * s.k * s.batch;
    secs += gm.predict(s).seconds;
  }
  return {w, flops / secs / 1e12};
}

WidthChoice best_swiglu_width(const hw::GemmModel& gm, std::int64_t tokens, int hidden, std::int64_t width,
                              std::int64_t batch) {
  const std::int64_t center = width > 0 ? width : std::llround(8.0 * hidden / 3);
  WidthChoice best = mlp_throughput(gm, tokens, hidden, round_to(center, 64), batch);
  // Steps of 64 over +-10%; coarser (a multiple of 64) past ~330K so the search stays at
  // about kMaxWidthCandidates predictions whatever the width.
  constexpr double kMaxWidthCandidates = 1024;
  const std::int64_t step = 64 * (1 + static_cast<std::int64_t>(0.2 * center / (64 * kMaxWidthCandidates)));
  for (std::int64_t w = ceil_div(static_cast<std::int64_t>(center * 0.9), 64) * 64; w <= center * 1.1; w += step) {
    const WidthChoice c = mlp_throughput(gm, tokens, hidden, w, batch);
    // Prefer the candidate nearest the requested width unless another is clearly faster (>1%).
    if (c.tflops > best.tflops * 1.01 ||
        (c.tflops > best.tflops * 0.99 && std::abs(w - center) < std::abs(best.width - center) && c.tflops >= best.tflops))
      best = c;
  }
  return best;
}

std::vector<Finding> check_sizing(const Setup& s) {
  const model::ModelConfig& m = s.model;
  const mesh::Shape& l = s.layout;
  const hw::GemmModel gm(s.hardware.profile, s.hardware.gemm_profile);
  const StepEstimate step = estimate_step(s);
  const int sms = s.hardware.profile.sm_count;
  std::vector<Finding> out;

  // Step time per GEMM name, to skip what does not matter (< 1% of the GEMM time).
  std::map<std::string, double> share;
  for (const auto& g : step.gemms) share[g.gemm.name] += g.seconds() / step.gemm_seconds;

  for (const auto& g : step.gemms) {
    if (g.gemm.pass != "fwd") continue;
    const auto& gg = g.gemm;
    const double sh = share[gg.name];
    if (sh < 0.01) continue;
    const auto& p = g.prediction;
    const std::string shape = fmt::format("{} [{} x {} x {}{}]", gg.name, gg.m, gg.n, gg.k,
                                          gg.batch > 1 ? fmt::format(" x{}", gg.batch) : std::string());
    // Alignment of the weight dimensions (n out, k in) to 64 elements (128 B in bf16). The
    // gain is for the same useful work: the padded GEMM's time against today's.
    for (int dim = 0; dim < 2; ++dim) {
      const std::int64_t v = dim == 0 ? gg.n : gg.k;
      if (v % 64 == 0 || gg.name == "lm_head") continue;  // the vocab rule covers the head
      const std::int64_t fixed = (v + 63) / 64 * 64;
      const hw::GemmShape padded = dim == 0 ? hw::GemmShape{gg.m, fixed, gg.k, gg.batch}
                                            : hw::GemmShape{gg.m, gg.n, fixed, gg.batch};
      const double gain = p.seconds / gm.predict(padded).seconds - 1;
      out.push_back({"alignment", gg.name, v % 8 ? "warn" : "info",
                     fmt::format("{}: {} {} is not a multiple of 64 elements{}", shape, dim == 0 ? "n" : "k", v,
                                 v % 8 ? " (nor of 8: no 16-byte vector loads)" : ""),
                     fmt::format("pad {} -> {} per GPU ({}): predicted {:+.1f}% on this GEMM ({:.1f}% of step GEMM time)",
                                 v, fixed, weight_key(gg.name, dim == 0), pct(gain), pct(sh)),
                     gain});
    }
    // Wave quantization, where it costs something (>= 2% of the step's GEMM time).
    if (p.wave_efficiency < 0.85 && p.waves <= 8 && sh >= 0.02) {
      std::string fix;
      double gain = 0;
      const bool up_gate = gg.name.size() > 8 && gg.name.compare(gg.name.size() - 8, 8, "_up_gate") == 0;
      if (up_gate) {
        // The SwiGLU width: n = 2 x width, so widths in steps of 64 within 10%, by useful
        // TFLOP/s (the width changes the work too).
        std::int64_t best_n = gg.n;
        double best = p.tflops;
        for (std::int64_t n = std::max<std::int64_t>(128, (gg.n * 9 / 10 + 127) / 128 * 128); n <= gg.n * 11 / 10; n += 128) {
          const double t2 = gemm_tflops(gm, gg.m, n, gg.k, gg.batch);
          if (t2 > best * 1.02) best = t2, best_n = n;
        }
        if (best_n != gg.n) {
          gain = best / p.tflops - 1;
          fix = fmt::format("{} {} -> {} per GPU: predicted {:+.1f}% on this GEMM ({:.1f}% of step GEMM time)",
                            weight_key(gg.name, true), gg.n / 2, best_n / 2, pct(gain), pct(sh));
        }
      }
      if (fix.empty()) {
        // The token dimension: m within -12%..+50% by TFLOP/s, in steps of 512 tokens (keeps
        // b*s a multiple of 512) or of 128 tokens per expert.
        const std::int64_t step_m = gg.name.rfind("expert", 0) == 0 ? 128 : 512;
        std::int64_t best_m = gg.m;
        double best = p.tflops;
        for (std::int64_t m2 = std::max<std::int64_t>(step_m, gg.m * 7 / 8 / step_m * step_m); m2 <= gg.m * 3 / 2;
             m2 += step_m) {
          const double t2 = gemm_tflops(gm, m2, gg.n, gg.k, gg.batch);
          if (t2 > best * 1.02) best = t2, best_m = m2;
        }
        if (best_m != gg.m) {
          gain = best / p.tflops - 1;
          fix = fmt::format("{} {} -> {} (micro-batch x seq{}): predicted {:+.1f}% on this GEMM ({:.1f}% of step GEMM time)",
                            gg.name.rfind("expert", 0) == 0 ? "tokens per expert" : "tokens per GEMM", gg.m, best_m,
                            gg.name.rfind("expert", 0) == 0 ? " x top_k / experts" : "", pct(gain), pct(sh));
        } else {
          fix = fmt::format("no nearby shape does better; {:.1f}% of step GEMM time", pct(sh));
        }
      }
      out.push_back({"wave", gg.name, "warn",
                     fmt::format("{}: {} tiles of {}x{} on {} SMs/CUs = {} wave(s), {:.0f}% of the SM slots busy", shape,
                                 p.tiles, p.tile_m, p.tile_n, sms, p.waves, pct(p.wave_efficiency)),
                     fix, gain});
    }
  }

  // b*s: the token dimension of every GEMM.
  const std::int64_t t = step.tokens_per_gpu_microbatch;
  if (pow2_factor(t) < 64)
    out.push_back({"tokens", "micro_batch x seq", "warn",
                   fmt::format("tokens per GPU micro-batch b*s/(cp*tsp) = {} has a power-of-two factor of only {}", t,
                               pow2_factor(t)),
                   fmt::format("seq {} -> {}", s.seq, (s.seq + 127) / 128 * 128), 0});
  else
    out.push_back({"tokens", "micro_batch x seq", "ok",
                   fmt::format("b*s per GPU = {} (power-of-two factor {})", t, pow2_factor(t)), "", 0});

  // Heads: h/a (head dim) and h/t.
  if (m.head_dim % 64 != 0 || m.head_dim < 64)
    out.push_back({"heads", "head_dim", "warn",
                   fmt::format("head_dim {} is {}: attention kernels are tuned for 64/128", m.head_dim,
                               m.head_dim < 64 ? "below 64" : "not a multiple of 64"),
                   fmt::format("head_dim {} -> {}", m.head_dim, round_to(m.head_dim, 64)), 0});
  else
    out.push_back({"heads", "head_dim", "ok", fmt::format("h/a = head_dim {} (power-of-two factor {})", m.head_dim,
                                                          pow2_factor(m.head_dim)), "", 0});
  const std::int64_t ht = m.hidden / (l.tp * l.tsp);
  if (pow2_factor(ht) < 64)
    out.push_back({"tp", "hidden/tp", "warn",
                   fmt::format("h/t = {}/{} = {} has a power-of-two factor of only {}", m.hidden, l.tp * l.tsp, ht,
                               pow2_factor(ht)),
                   "a tp*tsp degree that leaves hidden/(tp*tsp) a multiple of 64", 0});
  if (m.kv_heads % (l.tp * l.tsp) != 0)
    out.push_back({"tp", "kv_heads", "info",
                   fmt::format("kv_heads {} < tp*tsp {}: each kv head is replicated on {} ranks", m.kv_heads,
                               l.tp * l.tsp, l.tp * l.tsp / std::max(1, std::gcd(m.kv_heads, l.tp * l.tsp))),
                   "", 0});

  // Vocabulary padding: rows per tp rank a multiple of 64, whole vocab a multiple of 128.
  {
    const std::int64_t q = 128LL * l.tp * l.tsp;
    const std::int64_t V = m.vocab_size;
    if (V > std::numeric_limits<std::int64_t>::max() - q)
      throw UsageError(fmt::format("vocab_size {} is too large to pad to a multiple of {}", V, q));
    const std::int64_t padded = ceil_div(V, q) * q;
    if (padded != V) {
      const double now = gemm_tflops(gm, t, ceil_div(V, l.tp * l.tsp), m.hidden, 1);
      const double then = gemm_tflops(gm, t, padded / (l.tp * l.tsp), m.hidden, 1);
      // Useful throughput: the padded head does more FLOPs, only V/padded of them useful.
      const double gain = then * (static_cast<double>(V) / padded) / now - 1;
      out.push_back({"vocab", "vocab_size", gain > 0 ? "warn" : "info",
                     fmt::format("vocab {} is not a multiple of {} (128 x tp*tsp)", V, q),
                     fmt::format("vocab_size {} -> {} (+{} padding rows): predicted {:+.1f}% useful LM-head throughput",
                                 V, padded, padded - V, pct(gain)),
                     gain});
    } else {
      out.push_back({"vocab", "vocab_size", "ok", fmt::format("vocab {} = 128 x {}", V, V / 128), "", 0});
    }
  }

  // SwiGLU widths: dense MLP and experts, at their per-GPU token counts.
  auto swiglu = [&](const char* key, int width, std::int64_t tokens, std::int64_t batch) {
    if (width <= 0) return;
    const std::int64_t w = ceil_div(width, l.tp * l.tsp);
    const WidthChoice now = mlp_throughput(gm, tokens, m.hidden, w, batch);
    const std::int64_t nearest = round_to(width, 64);
    const WidthChoice near64 = mlp_throughput(gm, tokens, m.hidden, nearest / (l.tp * l.tsp), batch);
    const WidthChoice best = best_swiglu_width(gm, tokens, m.hidden, width, batch);
    const double ratio = width / (8.0 * m.hidden / 3);
    const std::string note = fmt::format("{} {} = {:.3f} x 8/3*h; predicted SwiGLU GEMMs {:.0f} TFLOP/s", key, width,
                                         ratio, now.tflops);
    const std::int64_t best_w = best.width * l.tp * l.tsp;
    if (width % 64 != 0) {
      out.push_back({"swiglu", key, "warn", note + fmt::format(" ({} is not a multiple of 64)", width),
                     fmt::format("width {} -> {}: predicted {:+.0f}%{}", width, nearest, pct(near64.tflops / now.tflops - 1),
                                 best_w != nearest ? fmt::format("; best nearby {} ({:+.0f}%)", best_w,
                                                                 pct(best.tflops / now.tflops - 1))
                                                   : ""),
                     near64.tflops / now.tflops - 1});
    } else if (best.tflops > now.tflops * 1.03) {
      out.push_back({"swiglu", key, "info", note,
                     fmt::format("width {} -> {}: predicted {:+.1f}%", width, best_w, pct(best.tflops / now.tflops - 1)),
                     best.tflops / now.tflops - 1});
    } else {
      out.push_back({"swiglu", key, "ok", note, "", 0});
    }
  };
  if (model::moe_layer_count(m) < m.layers) swiglu("ffn_hidden", m.ffn_hidden, t, 1);
  if (m.experts > 0) {
    const std::int64_t te = tokens_per_local_expert(t, l.ep, m.top_k, m.experts);
    swiglu("expert_hidden", m.expert_hidden, te, m.experts / l.ep);

    // Tokens per expert: expert GEMMs against a large GEMM of the same weight.
    const double eff = gm.predict({te, 2LL * m.expert_hidden, m.hidden, m.experts / l.ep}).efficiency;
    const double big = gm.predict({65536, 2LL * m.expert_hidden, m.hidden, 1}).efficiency;
    std::int64_t need = te;
    while (need < (1LL << 22) && gm.predict({need, 2LL * m.expert_hidden, m.hidden, m.experts / l.ep}).efficiency < 0.9 * big)
      need *= 2;
    const double gflop = 2.0 * te * 2 * m.expert_hidden * m.hidden / 1e9;
    if (eff < 0.9 * big) {
      // In double: top_k x ep x seq can pass int64 where the step's own products did not.
      const double mb = std::ceil(static_cast<double>(need) * m.experts / (static_cast<double>(m.top_k) * l.ep * s.seq)) *
                        l.cp * l.tsp;
      out.push_back({"experts", "tokens per expert", "warn",
                     fmt::format("{} tokens per expert: expert up/gate GEMMs at {:.0f}% of peak ({:.1f} GFLOP each) vs "
                                 "{:.0f}% for large GEMMs",
                                 te, pct(eff), gflop, pct(big)),
                     fmt::format("~{} tokens per expert reach 90% of that: micro-batch {} -> {} (or ep / fewer experts)",
                                 need, s.micro_batch, fmt::format("{:.0f}", std::max(mb, s.micro_batch + 1.0))),
                     0});
    } else {
      out.push_back({"experts", "tokens per expert", "ok",
                     fmt::format("{} tokens per expert: expert up/gate GEMMs at {:.0f}% of peak ({:.1f} GFLOP each)", te,
                                 pct(eff), gflop),
                     "", 0});
    }
  }
  return out;
}

}  // namespace keel::size

#!/usr/bin/env python3
"""keel train against a PyTorch implementation of the same model and step, on one GPU.

The model (issue 5's benchmark): a decoder-only MoE with ZAYA1-like dimensions but standard
attention: hidden 2048, 16 query / 2 kv heads of 128, 16 SwiGLU experts of width 2048 at
top-1, vocab 262,272 with tied embeddings, 8 layers (all MoE), sequence 4096, 8K tokens per
step (2 sequences). The step: forward, cross-entropy + Switch aux loss (0.01) + router z-loss
(0.001), backward, global-norm clipping at 1.0, AdamW (fused, fp32 states).

PyTorch side: written here in plain torch (RMSNorm in fp32, RoPE, SDPA causal GQA attention,
a softmax top-1 router and a loop over experts as Hugging Face's MoE models do, tied LM head
with the full logits), bf16 autocast over fp32 parameters, torch.optim.AdamW(fused=True); run
eager and under torch.compile. keel side: `keel train` on the same dimensions (device: cuda)
reading random tokens from a uint32 indexed dataset this script writes.

Both report tokens/s (median over timed steps after warm-up), MFU = (6 x active parameters
including the LM head + 6 x layers x seq x (heads x head_dim)) per token x tokens/s over the
device's dense bf16 peak (989 TFLOP/s on H100/H200), and peak memory. Prints a table last.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

DIMS = dict(vocab=262272, hidden=2048, heads=16, kv_heads=2, head_dim=128, experts=16, expert_hidden=2048, top_k=1,
            layers=8, seq=4096, micro_batch=2)
AUX_W, Z_W, LR, WD, CLIP = 0.01, 0.001, 3e-4, 0.1, 1.0
PEAK = 989e12


def flops_per_token(d):
    D, Dh, Hq, Hkv = d["hidden"], d["head_dim"], d["heads"], d["kv_heads"]
    active = d["layers"] * (D * Dh * (2 * Hq + 2 * Hkv) + D * d["experts"] + 3 * D * d["expert_hidden"] * d["top_k"])
    active += D * d["vocab"]
    return 6 * active + 6 * d["layers"] * d["seq"] * Hq * Dh


def write_dataset(prefix, tokens, seq):
    """A Megatron indexed dataset of uint32 tokens (keel's dtype code 9), one document per row."""
    rows = tokens.reshape(-1, seq + 1)
    with open(prefix + ".bin", "wb") as f:
        f.write(rows.astype(np.uint32).tobytes())
    n = rows.shape[0]
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 9))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", n + 1))
        f.write(np.full(n, seq + 1, dtype=np.int32).tobytes())
        f.write((np.arange(n, dtype=np.int64) * (seq + 1) * 4).tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())


def keel_config(d, prefix, output_dir, steps, grad_accum=1, forced=False):
    """The keel train config of the benchmark model (device cuda, random-token dataset at prefix)."""
    return f"""device: cuda
model:
  name: bench-moe
  vocab_size: {d['vocab']}
  hidden: {d['hidden']}
  layers: {d['layers']}
  attention: gqa
  heads: {d['heads']}
  kv_heads: {d['kv_heads']}
  head_dim: {d['head_dim']}
  experts: {d['experts']}
  top_k: {d['top_k']}
  expert_hidden: {d['expert_hidden']}
  tied_embeddings: true
  rope_fraction: 1.0
  max_seq_len: {d['seq']}
router:
  aux_loss_weight: {AUX_W}
  z_loss_weight: {Z_W}{chr(10) + '  forced_balance: true' if forced else ''}
ce_chunk: 32768
data:
  datasets: {{train: {prefix}}}
  seq_length: {d['seq']}
  seed: 1
optimizer:
  lr: {LR}
  weight_decay: {WD}
  clip: {CLIP}
schedule:
  kind: constant
batch:
  micro_batch: {d['micro_batch']}
  grad_accum: {grad_accum}
steps: {steps}
log_interval: 1
output_dir: {output_dir}
checkpoint: {{final: false}}
mfu_peak_flops: {PEAK}
"""


def run_keel(keel, out, d, steps, warmup, forced=False):
    os.makedirs(out, exist_ok=True)
    shutil.rmtree(os.path.join(out, "run"), ignore_errors=True)  # keel train refuses another run's metrics
    rng = np.random.default_rng(0)
    prefix = os.path.join(out, "random")
    nrows = d["micro_batch"] * (steps + 4)
    write_dataset(prefix, rng.integers(0, d["vocab"], size=nrows * (d["seq"] + 1), dtype=np.uint64), d["seq"])
    cfg = keel_config(d, prefix, os.path.join(out, "run"), steps, forced=forced)
    path = os.path.join(out, "bench_train.yaml")
    open(path, "w").write(cfg)
    log = os.path.join(out, "keel_train.log")
    with open(log, "w") as f:
        r = subprocess.run([keel, "train", path], stdout=f, stderr=subprocess.STDOUT, timeout=600)
    if r.returncode != 0:
        print(open(log).read()[-3000:])
        return {"error": f"keel train exited {r.returncode}"}
    rows = [json.loads(line) for line in open(os.path.join(out, "run", "metrics.jsonl"))]
    tps = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row and row.get("step", 0) > warmup]
    mem = max(row.get("memory_mib", 0) for row in rows)
    loss = [row["loss"] for row in rows if "loss" in row]
    ce = [row["ce"] for row in rows if "ce" in row]
    # routing: the worst MoE layer's busiest expert over its fair share 1/E, median over the timed steps
    worst = [max(row[k] for k in row if k.startswith("routing_busiest_share.")) * d["experts"] for row in rows
             if row.get("step", 0) > warmup and any(k.startswith("routing_busiest_share.") for k in row)]
    return {"tokens_per_s": statistics.median(tps), "memory_gib": mem / 1024, "ce_first": ce[0], "ce_last": ce[-1],
            "steps": len(ce), "busiest_over_fair": statistics.median(worst) if worst else float("nan")}


def build_torch_model(d, dev, forced=False):
    """The benchmark MoE in plain torch, with keel's initialization (from torch's global RNG: seed it first).

    Module tree (the names a tensor-parallel plan addresses, bench/train_tp_torch.py): embed,
    layers[i].{n1, attn.{wq, wk, wv, wo}, n2, moe.{router, experts}}, norm, head (the LM head tied
    to embed, with the cross-entropy). The attention's head counts are attributes (n_heads,
    n_kv_heads) so that a rank of a tensor-parallel group can hold a slice of the heads, and the
    experts read their stacked weights through _local() (a DTensor's shard under tensor
    parallelism; the tensor itself otherwise), as torchtitan's models do."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    D, Hq, Hkv, Dh, E, FE, V = d["hidden"], d["heads"], d["kv_heads"], d["head_dim"], d["experts"], d["expert_hidden"], d["vocab"]
    T = d["seq"]

    def _local(w):
        return w.to_local() if hasattr(w, "to_local") else w

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(D))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight).to(x.dtype)

    inv = 1.0 / (10000.0 ** (torch.arange(0, Dh, 2, device=dev).float() / Dh))
    ang = torch.outer(torch.arange(T, device=dev).float(), inv)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]

    def rope(x):  # rotate-half, x [B, T, H, Dh]
        x1, x2 = x[..., : Dh // 2].float(), x[..., Dh // 2:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads, self.n_kv_heads = Hq, Hkv  # the heads this module computes (a shard's under TP)
            # Tensor degree above the kv heads (bench/train_tp_torch.py): k and v whole on every
            # rank, from replicated weights, their gradients summed over the group (kv_hook); this
            # rank's query heads read kv heads [kv_select[0], kv_select[0] + kv_select[1]).
            self.kv_select, self.kv_hook = None, None
            self.wq = nn.Linear(D, Hq * Dh, bias=False)
            self.wk = nn.Linear(D, Hkv * Dh, bias=False)
            self.wv = nn.Linear(D, Hkv * Dh, bias=False)
            self.wo = nn.Linear(Hq * Dh, D, bias=False)

        def forward(self, h):  # h [B, T, D]
            B, S = h.shape[0], h.shape[1]
            q = rope(self.wq(h).view(B, S, self.n_heads, Dh)).transpose(1, 2)
            if self.kv_select is not None:
                hl, (kv0, nkv) = _local(h), self.kv_select
                k = self.kv_hook(F.linear(hl, _local(self.wk.weight))).view(B, S, Hkv, Dh)
                v = self.kv_hook(F.linear(hl, _local(self.wv.weight))).view(B, S, Hkv, Dh)
                k = rope(k[:, :, kv0:kv0 + nkv]).transpose(1, 2)
                v = v[:, :, kv0:kv0 + nkv].transpose(1, 2)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return self.wo(a.transpose(1, 2).reshape(B, S, self.n_heads * Dh))
            k = rope(self.wk(h).view(B, S, self.n_kv_heads, Dh)).transpose(1, 2)
            v = self.wv(h).view(B, S, self.n_kv_heads, Dh).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.wo(a.transpose(1, 2).reshape(B, S, self.n_heads * Dh))

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_gate = nn.Parameter(torch.randn(E, FE, D) * 0.02)
            self.w_up = nn.Parameter(torch.randn(E, FE, D) * 0.02)
            self.w_down = nn.Parameter(torch.randn(E, D, FE) * 0.02)

        def forward(self, h, gate, sel, counts):
            """sum over each token's expert of gate x SwiGLU_e(h): a loop over experts (HF MoE models)."""
            w_gate, w_up, w_down = _local(self.w_gate), _local(self.w_up), _local(self.w_down)
            out = torch.zeros_like(h)
            order = torch.argsort(sel)
            splits = counts.tolist()
            start = 0
            for e in range(E):
                n = splits[e]
                if n == 0:
                    continue
                idx = order[start:start + n]
                start += n
                xe = h[idx]
                ye = (F.silu(xe @ w_gate[e].t().to(xe.dtype)) * (xe @ w_up[e].t().to(xe.dtype))) @ \
                    w_down[e].t().to(xe.dtype)
                out.index_add_(0, idx, (ye * gate[idx, None]).to(out.dtype))
            return out

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(D, E, bias=False)
            self.experts = Experts()
            self.last_counts = None  # the last forward's tokens per expert (routing reports)

        def forward(self, x):  # x [B, T, D]
            B, S = x.shape[0], x.shape[1]
            h = x.view(B * S, D)
            logits = self.router(h).float()
            probs = logits.softmax(-1)
            if forced:  # keel's router.forced_balance: token n -> expert n mod E, gate = its probability
                sel = torch.arange(B * S, device=h.device) % E
                gate = probs.gather(1, sel[:, None]).squeeze(1)
            else:
                gate, sel = probs.max(-1)
            counts = torch.bincount(sel, minlength=E)
            aux = E * ((counts.float() / (B * S)) * probs.mean(0)).sum()
            z = torch.logsumexp(logits, -1).pow(2).mean()
            self.last_counts = counts.detach()
            out = self.experts(h, gate, sel, counts)
            return out.view(B, S, D), aux, z

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1 = RMSNorm()
            self.attn = Attention()
            self.n2 = RMSNorm()
            self.moe = MoE()

        def forward(self, x):
            x = x + self.attn(self.n1(x))
            out, aux, z = self.moe(self.n2(x))
            return x + out, aux, z

    class TiedHead(nn.Module):
        """The LM head tied to the embedding (full logits) and the cross-entropy."""

        def __init__(self, embed):
            super().__init__()
            self.__dict__["embed"] = embed  # a reference, not a second registration

        def forward(self, x, targets):
            logits = x @ self.embed.weight.t().to(x.dtype)
            return F.cross_entropy(logits.view(-1, V).float(), targets.view(-1))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, D)
            nn.init.normal_(self.embed.weight, std=0.02)
            self.layers = nn.ModuleList([Layer() for _ in range(d["layers"])])
            self.norm = RMSNorm()
            self.head = TiedHead(self.embed)

        def forward(self, tokens, targets):
            x = self.embed(tokens)
            aux_total, z_total = 0.0, 0.0
            for layer in self.layers:
                x, aux, z = layer(x)
                aux_total, z_total = aux_total + aux, z_total + z
            ce = self.head(self.norm(x), targets)
            return ce + AUX_W * aux_total + Z_W * z_total, ce

    model = Model().to(dev)
    # keel's initialization: normal(0, 0.02) for every matrix, output projections (wo, w_down)
    # scaled by 1/sqrt(2 layers), norms 1; so both start from the same routing statistics.
    # (Drawn in the order of the model's first layout: embedding, then per layer the expert
    # stacks, the attention projections and the router.)
    out_scale = 1.0 / math.sqrt(2 * d["layers"])
    order = [("embed.weight", model.embed.weight)]
    for i, layer in enumerate(model.layers):
        ex, at = layer.moe.experts, layer.attn
        order += [(f"layers.{i}.w_gate", ex.w_gate), (f"layers.{i}.w_up", ex.w_up), (f"layers.{i}.w_down", ex.w_down),
                  (f"layers.{i}.wq.weight", at.wq.weight), (f"layers.{i}.wk.weight", at.wk.weight),
                  (f"layers.{i}.wv.weight", at.wv.weight), (f"layers.{i}.wo.weight", at.wo.weight),
                  (f"layers.{i}.router.weight", layer.moe.router.weight)]
    assert len(order) == sum(1 for p in model.parameters() if p.dim() >= 2)
    with torch.no_grad():
        for name, p in order:
            p.normal_(0.0, 0.02 * (out_scale if name.endswith("wo.weight") or name.endswith("w_down") else 1.0))
    return model


def run_torch(d, steps, warmup, compiled, ddp=False, forced=False):
    """One GPU, or with ddp=True one rank of a torchrun job (torch.distributed initialized):
    DistributedDataParallel (gradient all-reduce in buckets overlapped with backward) and
    ZeroRedundancyOptimizer (ZeRO-1: AdamW states sharded over the ranks)."""
    import torch

    torch.manual_seed(0)  # the same initialization on every rank
    dev = torch.device("cuda", torch.cuda.current_device())
    V, T, B = d["vocab"], d["seq"], d["micro_batch"]
    model = build_torch_model(d, dev, forced)
    if ddp:
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[dev.index])
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD,
                                      betas=(0.9, 0.95), fused=True)
        seed = 1 + dist.get_rank()  # each rank its own tokens
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.95), fused=True)
        seed = 1
    fwd = torch.compile(model) if compiled else model
    gen = torch.Generator(device=dev).manual_seed(seed)

    def step():
        tokens = torch.randint(0, V, (B, T), device=dev, generator=gen)
        targets = torch.randint(0, V, (B, T), device=dev, generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, ce = fwd(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return ce

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses, worst = [], [], []
    core = model.module if ddp else model
    for _ in range(steps):
        t0 = time.perf_counter()
        ce = step()
        losses.append(ce.item())
        times.append(time.perf_counter() - t0)
        counts = [layer.moe.last_counts for layer in core.layers if layer.moe.last_counts is not None]
        if counts:  # busiest expert over its fair share, worst layer (as keel's routing_busiest_share)
            worst.append(max((c.max() / c.float().mean()).item() for c in counts))
    mem = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, fwd
    torch.cuda.empty_cache()
    return {"tokens_per_s": B * T / statistics.median(times), "memory_gib": mem, "ce_first_timed": losses[0],
            "ce_last": losses[-1], "busiest_over_fair": statistics.median(worst) if worst else float("nan")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--forced-balance", action="store_true",
                    help="benchmarking only: token n -> expert n mod E on both sides (keel: router.forced_balance)")
    args = ap.parse_args()
    d = dict(DIMS)
    fpt = flops_per_token(d)
    results = {}
    t0 = time.time()
    results["keel"] = run_keel(args.keel, args.out, d, args.steps + args.warmup, args.warmup, args.forced_balance)
    print(f"keel: {results['keel']} ({time.time() - t0:.0f} s)", flush=True)
    if not args.skip_torch:
        for name, compiled in (("torch eager", False), ("torch.compile", True)):
            if compiled and args.skip_compile:
                continue
            t0 = time.time()
            try:
                results[name] = run_torch(d, args.steps, args.warmup, compiled, forced=args.forced_balance)
            except Exception as e:  # report and go on: the table shows what ran
                results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: {results[name]} ({time.time() - t0:.0f} s)", flush=True)
    json.dump({"dims": d, "flops_per_token": fpt, "results": results}, open(os.path.join(args.out, "train_vs_torch.json"), "w"),
              indent=1)
    import torch
    print(f"\n== keel train vs PyTorch ({torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"{d['layers']} MoE layers, hidden {d['hidden']}, {d['experts']} experts top-{d['top_k']}, vocab {d['vocab']}, "
          f"seq {d['seq']}, {d['micro_batch'] * d['seq']} tokens/step)")
    print(f"{'':16}{'tokens/s':>10}{'model TFLOP/s':>15}{'MFU':>7}{'peak GiB':>10}{'busiest/fair':>14}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:16}  {r['error']}")
            continue
        tf = r["tokens_per_s"] * fpt
        bf = r.get("busiest_over_fair", float("nan"))
        print(f"{name:16}{r['tokens_per_s']:10.0f}{tf / 1e12:15.1f}{100 * tf / PEAK:6.1f}%{r['memory_gib']:10.1f}"
              f"{bf:14.2f}{'  NOT a headline: an expert above 2x its share' if bf > 2 else ''}")
    print(f"(routing: the worst MoE layer's busiest expert over its fair share 1/{d['experts']}, median over the "
          f"timed steps; random tokens, no skip class{'; forced balance' if args.forced_balance else ''})")
    k = results.get("keel", {})
    for name in ("torch eager", "torch.compile"):
        r = results.get(name, {})
        if "tokens_per_s" in k and "tokens_per_s" in r:
            print(f"keel / {name}: {k['tokens_per_s'] / r['tokens_per_s']:.2f}x")
    if "tokens_per_s" in k:
        print(f"keel / 30.5K tok/s (HF Qwen3-MoE eager reference): {k['tokens_per_s'] / 30500:.2f}x (target >= 2)")


if __name__ == "__main__":
    main()

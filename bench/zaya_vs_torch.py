#!/usr/bin/env python3
"""keel train against a plain-PyTorch ZAYA1 of the same shape and step, on one GPU.

The model (issue 6's benchmark): the "ZAYA1-shaped model", the first 8 layers of ZAYA1-8B
(configs/zaya1-8b.yaml with layers: 8): hidden 2048; every layer a CCA attention stage (8 query
/ 2 kv heads of 128, latent q 1024 / k 256 / v 256, depthwise + grouped causal convs of width 2,
partial RoPE on 64 of 128 dims, base 10,000) followed by a top-1 MoE stage (ZAYA1's MLP router:
down-projection to 256 with bias, exponential depth averaging, RMSNorm, 3-layer GELU MLP to
16 experts + 1 skip class; 16 SwiGLU experts of width 2048); residual scaling (x + b) * s on
both streams before every stage and before the final norm; vocabulary 262,272 with tied
embeddings. Sequence 4096, 2 sequences = 8,192 tokens per step. The step: forward,
cross-entropy (no aux or z loss: ZAYA1's router balances with its selection bias), backward,
global-norm clipping at 1.0, AdamW on both sides (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight
decay 0.1 on matrices, embeddings and conv weights, none on 1-D tensors; fp32 master weights and
states; keel's config leaves optimizer.muon off), then the aux-loss-free balancing-bias update
bias_c += 0.01 * sign(mean load - load_c) over all 17 classes (keel's controller; the PyTorch
side runs the same rule on the GPU). `--muon` switches both sides to ZAYA1's optimizer split:
Muon (RMS-matched to AdamW, 5 Newton-Schulz steps, bf16 iterates) on every 2-D/3-D weight but
the embeddings and conv weights, AdamW on those and the 1-D tensors (keel: optimizer.muon;
PyTorch: TorchMuon below, the same step in plain torch, under torch.compile in the compiled run).

keel side: `keel train` (device: cuda; bf16 GEMMs, fp32 master weights, docs/gpu_training.md)
reading uniform random tokens from a uint32 indexed dataset this script writes.

PyTorch side: written here in plain torch, following keel's CPU reference op by op
(src/ops/cca.cc, causal_conv.cc, zaya_router.cc, residual_scale.cc, src/train/zaya_layers.cc,
model.cc): CCA = one [q; k] projection, F.conv1d depthwise then grouped (one 128 x 128 mix per
head and tap) over the sequence left-padded by 2, the pre-conv mixing terms
(q + k)/2 and mean_q/2 + k/2, L2 norm x sqrt(128) (x the per-kv-head temperature on k),
rotate-half partial RoPE, values = [x_t W_v1 | x_{t-1} W_v2], causal GQA
scaled_dot_product_attention, o_proj; the MLP router in fp32 where keel keeps fp32 (EDA
state, norm, softmax), top-1 by argmax(p + bias), gate = the unbiased p, skip class
returning 0 (Hugging Face's modeling_zaya.py masks its probability to 0); SwiGLU experts run by a loop over experts as Hugging Face MoE models do;
fp32 residual streams; tied LM head with the full logits. bf16 autocast over fp32 parameters,
torch.optim.AdamW(fused=True). Run eager and under torch.compile(model): the expert loop, whose
shapes change every step, is excluded by torch.compiler.disable (no recompiles), so Dynamo runs
the loop over layers eagerly and compiles each layer's residual scaling, norms, CCA and router
(two variants: layer 0 has no residual yet) and the final norm + LM head + loss. Both sides
start from keel's initialization rule (normal(0, 0.02) for tensors of 2+ dims, output
projections wo and w_down scaled by 1/sqrt(2 layers), 1-D tensors 1, biases 0, the skip
class's selection bias -1).

Reported: tokens/s (median over the timed steps after warm-up), model FLOPs and MFU with one
formula for both sides (keel's model_flops_per_micro_batch): per token
  6 x active parameters + 6 x layers x seq x (heads x head_dim)        (causal attention)
where the active parameters are, per layer, the CCA projections D(2 Q + 2 KV), both convs
C (W0 + head_dim W1), the router D R + 2 R^2 + R (E + 1), one expert 3 D F (skip-routed
tokens counted as routed: an upper bound), plus the LM head D V; MFU over the dense bf16 peak
of 989 TFLOP/s (H100/H200). Peak memory: keel's four device arenas; PyTorch's
max_memory_allocated. Prints a table last and writes OUT/zaya_vs_torch.json.

`--tiny` shrinks every dimension (runs on the CPU in seconds with `--device cpu`: a check of
the generated keel config and of the PyTorch model). `--parity` (with `--tiny --device cpu`)
checks the PyTorch model against keel's CPU reference: keel trains a few steps on a batch
that is the same every step and checkpoints each one; the PyTorch model loads each
checkpoint (weights, AdamW moments, selection biases) and must reproduce keel's next loss
and, after one step of its own, keel's next checkpoint (with `--muon`: Muon's momentum too, so
the check covers TorchMuon against keel's fp32 CPU Muon). `--ablations` also times keel on the
same model with GQA attention (same heads) instead of CCA, and without the skip class, to show
where keel's time goes. `--forced-balance` (benchmarking only) routes token n of each step's
flattened [B*T] tokens to expert n mod E on both sides, never to skip (keel: router.forced_balance,
docs/train.md; the PyTorch router picks the same classes), gate = p of that class: throughput
with perfectly balanced experts, as Megatron's forced load balancing.
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

# The 8-layer cut of configs/zaya1-8b.yaml, at ZAYA1's pretraining RoPE base and length (10000,
# 4096; the YAML is the released model: 5e6, 131072).
ZAYA8 = dict(name="zaya1-8b-8l", attention="cca", skip=True, vocab=262272, hidden=2048, layers=8, heads=8, kv_heads=2,
             head_dim=128, conv0=2, conv1=2, experts=16, expert_hidden=2048, router_hidden=256, rope_fraction=0.5,
             rope_base=10000.0, eps=1e-5, seq=4096, micro_batch=2)
# --tiny: the same structure at toy sizes (CPU in seconds).
TINY = dict(name="zaya1-tiny-bench", attention="cca", skip=True, vocab=512, hidden=128, layers=3, heads=4, kv_heads=2,
            head_dim=64, conv0=2, conv1=2, experts=4, expert_hidden=128, router_hidden=32, rope_fraction=0.5,
            rope_base=10000.0, eps=1e-5, seq=64, micro_batch=2)
LR, WD, BETAS, ADAM_EPS, CLIP, BIAS_RATE, INIT_STD = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0, 0.01, 0.02
PEAK = 989e12


def flops_per_token(d):
    """keel's model_flops_per_micro_batch / tokens (src/train/model.cc)."""
    D, Dh, Hq, Hkv, R, E = d["hidden"], d["head_dim"], d["heads"], d["kv_heads"], d["router_hidden"], d["experts"]
    per_layer = D * Dh * (2 * Hq + 2 * Hkv)                              # w_qk, w_v, o_proj
    if d["attention"] == "cca":
        per_layer += (Hq + Hkv) * Dh * (d["conv0"] + Dh * d["conv1"])    # depthwise + grouped conv
    per_layer += D * R + 2 * R * R + R * (E + int(d["skip"])) + 3 * D * d["expert_hidden"]  # router, expert
    active = d["layers"] * per_layer + D * d["vocab"]                    # + LM head
    return 6 * active + 6 * d["layers"] * d["seq"] * Hq * Dh


def total_params(d):
    """Parameter count of keel's layout (model::param_layout) for these dimensions."""
    D, Dh, Hq, Hkv, R, E, F, L = (d["hidden"], d["head_dim"], d["heads"], d["kv_heads"], d["router_hidden"],
                                  d["experts"], d["expert_hidden"], d["layers"])
    Q, KV = Hq * Dh, Hkv * Dh
    C = Q + KV
    n = d["vocab"] * D
    for l in range(L):
        n += (4 if l else 2) * D + D                                       # res_scale.attn, attn_norm
        if d["attention"] == "cca":
            n += C * D + KV * D + C * d["conv0"] + C + C * Dh * d["conv1"] + C + Hkv + D * Q
        else:                                                              # gqa: wq, wk, wv, wo
            n += Q * D + 2 * KV * D + D * Q
        n += 4 * D + D                                                     # res_scale.mlp, mlp_norm
        n += R * D + R + (R if l else 0) + R + 2 * (R * R + R) + (E + 1) * R
        n += 3 * E * F * D
    return n + 4 * D + D


def write_dataset(prefix, rows):
    """A Megatron indexed dataset of uint32 tokens (keel's dtype code 9), one document per row."""
    rows = np.ascontiguousarray(rows, dtype=np.uint32)
    n, length = rows.shape
    with open(prefix + ".bin", "wb") as f:
        f.write(rows.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 9))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", n + 1))
        f.write(np.full(n, length, dtype=np.int32).tobytes())
        f.write((np.arange(n, dtype=np.int64) * length * 4).tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())


def keel_config(d, prefix, out, steps, device, checkpoint_every=0, lr=LR, bias_rate=BIAS_RATE, muon=False,
                forced=False):
    ckpt = "{final: false}" if checkpoint_every == 0 else f"{{interval: {checkpoint_every}, dir: {out}/ckpt}}"
    return f"""# written by bench/zaya_vs_torch.py: the ZAYA1-shaped model
device: {device}
model:
  name: {d['name']}
  vocab_size: {d['vocab']}
  hidden: {d['hidden']}
  layers: {d['layers']}
  attention: {d['attention']}
  heads: {d['heads']}
  kv_heads: {d['kv_heads']}
  head_dim: {d['head_dim']}
  cca_q_dim: {d['heads'] * d['head_dim']}
  cca_k_dim: {d['kv_heads'] * d['head_dim']}
  cca_v_dim: {d['kv_heads'] * d['head_dim']}
  cca_conv_width: {d['conv0']}
  cca_group_conv_width: {d['conv1']}
  experts: {d['experts']}
  top_k: 1
  expert_hidden: {d['expert_hidden']}
  router_hidden: {d['router_hidden']}
  router_mlp_layers: 3
  router_skip_expert: {'true' if d['skip'] else 'false'}
  tied_embeddings: true
  residual_scaling: true
  rope_fraction: {d['rope_fraction']}
  rope_base: {d['rope_base']}
  norm_eps: {d['eps']}
  max_seq_len: {d['seq']}
recompute: none
router:
  aux_loss_weight: 0.0
  z_loss_weight: 0.0
  balance: sign
  lr_scale: 1.0
  bias_update_rate: {bias_rate}{chr(10) + '  forced_balance: true' if forced else ''}
ce_chunk: 32768
data:
  datasets: {{train: {prefix}}}
  seq_length: {d['seq']}
  seed: 1
optimizer:
  lr: {lr}
  beta1: {BETAS[0]}
  beta2: {BETAS[1]}
  eps: {ADAM_EPS}
  weight_decay: {WD}
  clip: {CLIP}
  muon: {{enabled: {'true' if muon else 'false'}}}
schedule:
  kind: constant
batch:
  micro_batch: {d['micro_batch']}
  grad_accum: 1
steps: {steps}
log_interval: 1
output_dir: {out}/run
checkpoint: {ckpt}
mfu_peak_flops: {PEAK}
seed: 1234
"""


def keel_routing(rows, d, warmup):
    """The routing of keel's timed steps from its metrics: the median over steps of the worst MoE
    layer's busiest class over its fair share (1 / classes, skip included), and the mean skip share."""
    classes = d["experts"] + (1 if d["skip"] else 0)
    timed = [r for r in rows if r.get("step", 0) > warmup and any(k.startswith("routing_busiest_share.") for k in r)]
    if not timed:
        return {}
    worst = [max(r[k] for k in r if k.startswith("routing_busiest_share.")) * classes for r in timed]
    skip = [statistics.mean(r[k] for k in r if k.startswith("routing_skip_share.")) for r in timed]
    return {"busiest_over_fair": statistics.median(worst), "skip_share": statistics.mean(skip)}


def run_keel(keel, out, d, steps, warmup, device, rows=None, checkpoint_every=0, lr=LR, bias_rate=BIAS_RATE,
             timeout=900, muon=False, forced=False):
    os.makedirs(out, exist_ok=True)
    shutil.rmtree(os.path.join(out, "run"), ignore_errors=True)  # keel train refuses another run's metrics
    prefix = os.path.join(out, "random")
    if rows is None:
        rng = np.random.default_rng(0)
        nrows = d["micro_batch"] * (steps + 4)
        rows = rng.integers(0, d["vocab"], size=(nrows, d["seq"] + 1), dtype=np.uint64)
    write_dataset(prefix, rows)
    path = os.path.join(out, "keel_train.yaml")
    with open(path, "w") as f:
        f.write(keel_config(d, prefix, out, steps, device, checkpoint_every, lr, bias_rate, muon, forced))
    log = os.path.join(out, "keel_train.log")
    metrics = os.path.join(out, "run", "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run([keel, "train", path], stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    text = open(log).read()
    if r.returncode != 0:
        print(text[-3000:])
        last = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
        return {"error": f"keel train exited {r.returncode}: {last[0][:300]}"}
    rows_ = [json.loads(line) for line in open(metrics)]
    tps = [row["tokens_per_s"] for row in rows_ if "tokens_per_s" in row and row.get("step", 0) > warmup]
    ce = [row["ce"] for row in rows_ if "ce" in row]
    res = {"tokens_per_s": statistics.median(tps) if tps else float("nan"),
           "memory_gib": max(row.get("memory_mib", 0) for row in rows_) / 1024,
           "keel_mfu": statistics.median(row["mfu"] for row in rows_ if "mfu" in row and row.get("step", 0) > warmup)
           if tps else 0,
           "ce": ce, "load_max": [row["expert_load_max"] for row in rows_ if "expert_load_max" in row],
           **keel_routing(rows_, d, warmup),
           "wall_s": time.time() - t0}
    for line in text.splitlines():
        if line.startswith("keel train: model"):
            res["header"] = line.strip()
            try:
                res["params"] = int(line.split("(")[1].split(" parameters")[0])
            except (IndexError, ValueError):
                pass
    return res


# ---------------------------------------------------------------------------------------------
# The PyTorch ZAYA1
# ---------------------------------------------------------------------------------------------

def build_torch_model(d, dev, act_dtype, forced=False):
    """The ZAYA1 model in plain torch; keel_params() maps keel's parameter names onto it.
    forced: keel's router.forced_balance (token n of the flattened [B*T] -> expert n mod E).

    Module tree (the names a tensor-parallel plan addresses, bench/train_tp_torch.py): embed,
    layers[i].{res_attn, attn_norm, cca, res_mlp, mlp_norm, moe.{router, experts}, sel_bias},
    final_res, final_norm, head (the LM head tied to embed, with the cross-entropy). CCA's head
    counts and value shift are attributes, so that a rank of a tensor-parallel group can hold a
    slice of the heads; CCA and the experts read their weights through _local() (a DTensor's
    shard under tensor parallelism; the tensor itself otherwise), as torchtitan's models do."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    D, nq, nkv, Dh = d["hidden"], d["heads"], d["kv_heads"], d["head_dim"]
    Q, KV, G = nq * Dh, nkv * Dh, nq // nkv
    C = Q + KV
    W0, W1 = d["conv0"], d["conv1"]
    E, FE, R, V, L, T = d["experts"], d["expert_hidden"], d["router_hidden"], d["vocab"], d["layers"], d["seq"]
    classes = E + 1  # + the skip class
    eps = d["eps"]
    sqrt_d = math.sqrt(Dh)

    # RoPE table as keel's make_table: angles in double, stored fp32; first rot dims rotated.
    rot = int(round(d["rope_fraction"] * Dh))
    f64 = torch.float64
    inv = torch.tensor([d["rope_base"] ** (-2.0 * i / rot) for i in range(rot // 2)], dtype=f64)
    ang = torch.outer(torch.arange(T, dtype=f64), inv)
    cos = ang.cos().float().to(dev)[None, :, None, :]
    sin = ang.sin().float().to(dev)[None, :, None, :]

    # The positions of the tokens a forward sees (Model.forward's `positions`, [T]: a context-
    # parallel rank's share of the sequence); None: 0..T-1.
    at = {"positions": None}

    def rope(x):  # x [B, T, H, Dh] fp32; rotate-half inside the first `rot` channels
        h = rot // 2
        c, s = cos, sin
        if at["positions"] is not None:
            c, s = cos[:, at["positions"]], sin[:, at["positions"]]
        elif x.shape[1] != cos.shape[1]:
            c, s = cos[:, :x.shape[1]], sin[:, :x.shape[1]]
        x1, x2 = x[..., :h], x[..., h:rot]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], -1)

    def rmsnorm(x, w, out_dtype):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(out_dtype)

    def vec(n, fill):
        return nn.Parameter(torch.full((n,), float(fill)))

    def _local(w):
        return w.to_local() if hasattr(w, "to_local") else w

    class ResScale(nn.Module):  # merge(r, h) = (r + r_bias) * r_scale + (h + h_bias) * h_scale
        def __init__(self, with_r):
            super().__init__()
            self.h_scale, self.h_bias = vec(D, 1), vec(D, 0)
            self.with_r = with_r
            if with_r:
                self.r_scale, self.r_bias = vec(D, 1), vec(D, 0)

        def forward(self, r, h):
            out = (h + self.h_bias) * self.h_scale
            return out if r is None else (r + self.r_bias) * self.r_scale + out

    class CCA(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_qk = nn.Parameter(torch.empty(C, D))           # [linear_q; linear_k]
            self.w_v = nn.Parameter(torch.empty(KV, D))           # [val_proj1; val_proj2]
            self.conv0_w = nn.Parameter(torch.empty(C, 1, W0))    # depthwise
            self.conv0_b = vec(C, 0)
            self.conv1_w = nn.Parameter(torch.empty(C, Dh, W1))   # grouped: one group per head
            self.conv1_b = vec(C, 0)
            self.temp = vec(nkv, 1)
            self.wo = nn.Parameter(torch.empty(D, Q))
            # The q / kv heads this module computes (a shard's under tensor parallelism, whose
            # w_qk, convs and their biases then hold [its q heads; its k heads]) and the first
            # value channel that takes the previous token (the second half of val_proj).
            self.nq, self.nkv, self.v_shift_from = nq, nkv, KV // 2

        def forward(self, x):  # x [B, T, D]
            B, T = x.shape[0], x.shape[1]
            nq, nkv = self.nq, self.nkv
            Q, C = nq * Dh, (nq + nkv) * Dh
            qk0 = F.linear(x, _local(self.w_qk))                                # [B, T, C]
            c = F.pad(qk0.transpose(1, 2), ((W0 - 1) + (W1 - 1), 0))            # causal: left pad
            c = F.conv1d(c, _local(self.conv0_w), _local(self.conv0_b), groups=C)        # [B, C, T + W1 - 1]
            c = F.conv1d(c, _local(self.conv1_w), _local(self.conv1_b), groups=C // Dh)  # [B, C, T]
            conv = c.transpose(1, 2).float()
            q0 = qk0[..., :Q].float().view(B, T, nkv, G, Dh)
            k0 = qk0[..., Q:].float().view(B, T, nkv, 1, Dh)
            aq = conv[..., :Q].view(B, T, nkv, G, Dh) + 0.5 * (q0 + k0)        # m_q = (q0 + k0) / 2
            ak = conv[..., Q:].view(B, T, nkv, Dh) + 0.5 * q0.mean(3) + 0.5 * k0[:, :, :, 0]
            q = aq * (sqrt_d * torch.rsqrt(aq.pow(2).sum(-1, keepdim=True)))
            k = ak * (sqrt_d * torch.rsqrt(ak.pow(2).sum(-1, keepdim=True))) * _local(self.temp).view(nkv, 1)
            q = rope(q.reshape(B, T, nq, Dh)).to(act_dtype)
            k = rope(k).to(act_dtype)
            v = F.linear(x, _local(self.w_v))                                   # [B, T, KV]
            half = self.v_shift_from                                            # second half: previous token
            v = torch.cat([v[..., :half], F.pad(v[:, :-1, half:], (0, 0, 1, 0))], -1).view(B, T, nkv, Dh)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2).to(act_dtype),
                                                 is_causal=True, scale=1.0 / sqrt_d, enable_gqa=True)
            return F.linear(att.transpose(1, 2).reshape(B, T, Q), _local(self.wo))

    class GQA(nn.Module):
        """d["attention"] == "gqa": keel's GQA layer at the same widths (q, k, v and o projections,
        RoPE on the first `rot` channels, causal attention). The kv heads are repeated to the query
        heads before scaled_dot_product_attention, as torchtitan's models do, so that context
        parallelism's SDPA handlers (equal head counts) take it."""

        def __init__(self):
            super().__init__()
            self.wq = nn.Parameter(torch.empty(Q, D))
            self.wk = nn.Parameter(torch.empty(KV, D))
            self.wv = nn.Parameter(torch.empty(KV, D))
            self.wo = nn.Parameter(torch.empty(D, Q))

        def forward(self, x):  # x [B, T, D]
            B, T = x.shape[0], x.shape[1]
            q = rope(F.linear(x, self.wq).float().view(B, T, nq, Dh)).to(act_dtype)
            k = rope(F.linear(x, self.wk).float().view(B, T, nkv, Dh)).to(act_dtype)
            v = F.linear(x, self.wv).view(B, T, nkv, Dh).to(act_dtype)
            k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=1.0 / sqrt_d)
            return F.linear(att.transpose(1, 2).reshape(B, T, Q), self.wo)

    class Router(nn.Module):
        def __init__(self, eda):
            super().__init__()
            self.down_w, self.down_b = nn.Parameter(torch.empty(R, D)), vec(R, 0)
            self.eda_scale = vec(R, 1) if eda else None
            self.norm_w = vec(R, 1)
            self.mlp1_w, self.mlp1_b = nn.Parameter(torch.empty(R, R)), vec(R, 0)
            self.mlp2_w, self.mlp2_b = nn.Parameter(torch.empty(R, R)), vec(R, 0)
            self.out_w = nn.Parameter(torch.empty(classes, R))

        def forward(self, x, prev, bias):  # x [N, D]; prev [N, R] fp32 or None
            a = F.linear(x, self.down_w, self.down_b).float()
            if prev is not None:
                a = a + self.eda_scale * prev                                   # EDA
            u = rmsnorm(a, self.norm_w, act_dtype)
            h1 = F.gelu(F.linear(u, self.mlp1_w, self.mlp1_b))
            h2 = F.gelu(F.linear(h1, self.mlp2_w, self.mlp2_b))
            p = F.linear(h2, self.out_w).float().softmax(-1)
            if forced:  # keel's forced balance: token n -> expert n mod E, never skip
                idx = torch.arange(x.shape[0], device=x.device) % E
            else:
                idx = torch.argmax(p.detach() + bias, -1)                       # biased top-1 choice
            gate = p.gather(1, idx[:, None])[:, 0]                              # unbiased probability
            return a, idx, gate

    @torch.compiler.disable
    def experts_and_skip(x, idx, gate, w_gate, w_up, w_down):
        """y[n] = gate * Expert_idx(x[n]); skip class: 0. A loop over experts (HF MoE)."""
        counts = torch.bincount(idx, minlength=classes)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        order = torch.argsort(idx)
        splits = counts.tolist()
        start = 0
        for e in range(E):
            n = splits[e]
            if n == 0:
                continue
            rows = order[start:start + n]
            start += n
            xe = x[rows]
            ye = F.linear(F.silu(F.linear(xe, w_gate[e])) * F.linear(xe, w_up[e]), w_down[e])
            out.index_add_(0, rows, ye.float() * gate[rows, None])
        return out, counts

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_gate = nn.Parameter(torch.empty(E, FE, D))
            self.w_up = nn.Parameter(torch.empty(E, FE, D))
            self.w_down = nn.Parameter(torch.empty(E, D, FE))

        def forward(self, x, gate, idx):
            return experts_and_skip(x, idx, gate, _local(self.w_gate), _local(self.w_up), _local(self.w_down))

    class MoE(nn.Module):
        def __init__(self, l):
            super().__init__()
            self.router = Router(eda=l > 0)
            self.experts = Experts()

        def forward(self, x, prev, bias):  # x [B, T, D]
            B, T = x.shape[0], x.shape[1]
            x = x.view(B * T, D)
            state, idx, gate = self.router(x, prev, bias)
            y, counts = self.experts(x, gate, idx)
            return y.view(B, T, D), state, counts

    class Layer(nn.Module):
        def __init__(self, l):
            super().__init__()
            self.res_attn, self.res_mlp = ResScale(l > 0), ResScale(True)
            self.attn_norm, self.mlp_norm = vec(D, 1), vec(D, 1)
            self.cca = CCA() if d["attention"] == "cca" else GQA()  # (the name a TP plan addresses)
            self.moe = MoE(l)
            self.register_buffer("sel_bias", torch.zeros(classes))
            with torch.no_grad():
                self.sel_bias[E] = -1.0                                          # ZAYA1: skip starts at -1

        def forward(self, r, h, prev):
            r1 = self.res_attn(r, h)
            ya = self.cca(rmsnorm(r1, self.attn_norm, act_dtype))
            r2 = self.res_mlp(r1, ya)
            y, state, counts = self.moe(rmsnorm(r2, self.mlp_norm, act_dtype), prev, self.sel_bias)
            return r2, y, state, counts

    class TiedHead(nn.Module):
        """The LM head tied to the embedding (full logits) and the cross-entropy."""

        def __init__(self, embed):
            super().__init__()
            self.__dict__["embed"] = embed  # a reference, not a second registration

        def forward(self, x, targets):
            logits = F.linear(x, self.embed.weight)
            return F.cross_entropy(logits.view(-1, V).float(), targets.view(-1))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, D, _weight=torch.empty(V, D))
            self.layers = nn.ModuleList([Layer(l) for l in range(L)])
            self.final_res = ResScale(True)
            self.final_norm = vec(D, 1)
            self.head = TiedHead(self.embed)

        def forward(self, tokens, targets, positions=None):
            # (torch.compile falls back to eager for this loop, as the expert loop breaks the
            # graph; each Layer.forward and loss() are compiled as frames of their own.)
            at["positions"] = positions
            r, h, prev, counts = None, self.embed(tokens), None, []
            for layer in self.layers:
                r, h, prev, c = layer(r, h, prev)
                counts.append(c)
            return self.loss(r, h, targets), counts

        def loss(self, r, h, targets):
            return self.head(rmsnorm(self.final_res(r, h), self.final_norm, act_dtype), targets)

        def keel_params(self):
            """keel parameter name -> (torch parameter, keel shape)."""
            m = {"embed.weight": (self.embed.weight, None)}

            def rs(prefix, s):
                m[prefix + "h_scale"], m[prefix + "h_bias"] = (s.h_scale, None), (s.h_bias, None)
                if s.with_r:
                    m[prefix + "r_scale"], m[prefix + "r_bias"] = (s.r_scale, None), (s.r_bias, None)

            for l, y in enumerate(self.layers):
                p = f"layers.{l}."
                rs(p + "res_scale.attn.", y.res_attn)
                m[p + "attn_norm.weight"] = (y.attn_norm, None)
                a = y.cca
                if d["attention"] != "cca":
                    for k in ("wq", "wk", "wv", "wo"):
                        m[p + "attn." + k] = (getattr(a, k), None)
                else:
                    for k, t in (("w_qk", a.w_qk), ("w_v", a.w_v), ("conv0.weight", a.conv0_w),
                                 ("conv0.bias", a.conv0_b), ("conv1.weight", a.conv1_w), ("conv1.bias", a.conv1_b),
                                 ("temp", a.temp), ("wo", a.wo)):
                        m[p + "attn.cca." + k] = (t, (C, W0) if k == "conv0.weight" else None)
                rs(p + "res_scale.mlp.", y.res_mlp)
                m[p + "mlp_norm.weight"] = (y.mlp_norm, None)
                ro = y.moe.router
                for k, t in (("down.weight", ro.down_w), ("down.bias", ro.down_b), ("eda_scale", ro.eda_scale),
                             ("norm.weight", ro.norm_w), ("mlp1.weight", ro.mlp1_w), ("mlp1.bias", ro.mlp1_b),
                             ("mlp2.weight", ro.mlp2_w), ("mlp2.bias", ro.mlp2_b), ("out.weight", ro.out_w)):
                    if t is not None:
                        m[p + "moe.router." + k] = (t, None)
                for k in ("w_gate", "w_up", "w_down"):
                    m[p + "moe." + k] = (getattr(y.moe.experts, k), None)
            rs("final_res_scale.", self.final_res)
            m["final_norm.weight"] = (self.final_norm, None)
            return m

    model = Model().to(dev)
    # keel's init rule (model::init_parameters): normal(0, 0.02) for every tensor of 2+ dims,
    # output projections (wo, the experts' w_down) scaled by 1/sqrt(2 layers), and keel train's
    # router init (router.init_gain 1): the MLP router's r x r and output layers normal(0,
    # 1/sqrt(r)); 1-D as built. Drawn on the device (the same distribution as keel's, not the
    # same numbers).
    g = torch.Generator(device=dev).manual_seed(0)
    out_scale = 1.0 / math.sqrt(2 * L)
    with torch.no_grad():
        for name, (p, _) in model.keel_params().items():
            if p.dim() >= 2:
                out_proj = name.endswith(".wo") or name.endswith("w_down")
                router_mlp = ".moe.router." in name and not name.endswith("router.down.weight")
                std = 1.0 / math.sqrt(p.shape[-1]) if router_mlp else INIT_STD * (out_scale if out_proj else 1.0)
                p.normal_(0.0, std, generator=g)
    return model


def is_muon_matrix(name, p):
    """keel's Muon rule (optim default_rules(), docs/train.md): every 2-D/3-D weight except the
    embeddings and the conv weights; 1-D tensors stay on AdamW."""
    return p.dim() >= 2 and "embed" not in name and "conv" not in name


class TorchMuon:
    """Muon in plain torch, the step keel runs (optim/muon.h, docs/optim.md): per matrix,
    M = beta M + (1 - beta) g; U = (1 - beta) g + beta M (Nesterov); X = U / (||U||_F + 1e-7),
    transposed when tall; 5 x (A = X X^T; B = b A + c A A; X = a X + B X); then
    p = p (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) X. Expert stacks [E, out, in] are E
    matrices in one batched matmul. On the GPU the iterates are bf16 (fp32 accumulation), as in
    keel and the reference code; on the CPU (--parity) fp32. `compiled` runs the Newton-Schulz
    iteration under torch.compile, as the reference code does."""

    COEF, MOMENTUM, RMS = (3.4445, -4.7750, 2.0315), 0.95, 0.2

    def __init__(self, torch, params, lr, compiled=False):
        self.torch, self.params, self.lr = torch, list(params), lr
        self.momentum = {p: torch.zeros_like(p) for p in self.params}
        self.ns = torch.compile(self._orthogonalize) if compiled else self._orthogonalize

    def _orthogonalize(self, u):
        a, b, c = self.COEF
        tall = u.size(-2) > u.size(-1)
        x = u / (u.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        x = (x.mT if tall else x).to(self.torch.bfloat16 if u.is_cuda else self.torch.float32)
        for _ in range(5):
            A = x @ x.mT
            x = a * x + (b * A + c * (A @ A)) @ x
        return (x.mT if tall else x).float()

    def step(self):
        beta = self.MOMENTUM
        with self.torch.no_grad():
            for p in self.params:
                g, m = (p.grad if p.grad is not None else self.torch.zeros_like(p)), self.momentum[p]
                m.mul_(beta).add_((1 - beta) * g)
                o = self.ns((1 - beta) * g + beta * m)
                p.mul_(1 - self.lr * WD).add_(o, alpha=-self.lr * self.RMS * math.sqrt(max(p.shape[-2:])))


class Optimizer:
    """AdamW (torch.optim.AdamW) on everything, or with `muon` Muon on the weight matrices (as
    keel's optimizer.muon) and AdamW on the rest: embeddings, conv weights, 1-D tensors. With
    `zero` (a data-parallel rank) the AdamW states are sharded over the ranks by
    torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1)."""

    def __init__(self, torch, model, fused, lr=LR, muon=False, compiled=False, zero=False):
        named = list(model.keel_params().items())
        mats = [p for name, (p, _) in named if muon and is_muon_matrix(name, p)]
        ids = {id(p) for p in mats}
        rest = [p for p in model.parameters() if id(p) not in ids]
        groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": WD},
                  {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            self.adamw = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr, betas=BETAS,
                                                 eps=ADAM_EPS, fused=fused)
        else:
            self.adamw = torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=ADAM_EPS, fused=fused)
        self.muon = TorchMuon(torch, mats, lr, compiled) if mats else None

    def step(self):
        self.adamw.step()
        if self.muon:
            self.muon.step()

    def zero_grad(self, set_to_none=True):
        self.adamw.zero_grad(set_to_none=set_to_none)
        if self.muon:
            for p in self.muon.params:
                p.grad = None


def update_selection_bias(torch, model, counts, rate=BIAS_RATE):
    """keel's update_balancing_bias: bias_c += rate * sign(mean - load_c), on the device."""
    with torch.no_grad():
        for layer, c in zip(model.layers, counts):
            c = c.float()
            layer.sel_bias += rate * torch.sign(c.mean() - c)


def run_torch(d, steps, warmup, compiled, dev, muon=False, ddp=False, lr=LR, bias_rate=BIAS_RATE, forced=False):
    """One device, or with ddp=True one rank of a torchrun job (torch.distributed initialized, this
    rank's GPU current): DistributedDataParallel (gradient all-reduce in buckets overlapped with
    backward) with ZeroRedundancyOptimizer (ZeRO-1 AdamW), each rank on its own tokens, the
    selection-bias controller fed by the expert loads summed over the ranks (as keel's). DDP
    looks for unused parameters: a layer whose router sends every token to the skip class
    leaves its expert stacks without gradients. Muon is not offered with ddp (no distributed
    Muon in torch; a replicated one would be a straw man beside keel's)."""
    import torch

    if ddp and muon:
        raise ValueError("the data-parallel peer runs AdamW only")
    torch.manual_seed(0)
    cuda = dev == "cuda"
    model = build_torch_model(d, dev, torch.bfloat16 if cuda else torch.float32, forced)
    opt = Optimizer(torch, model, fused=cuda, lr=lr, muon=muon, compiled=compiled, zero=ddp)
    core, seed = model, 1
    if ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()], broadcast_buffers=False,
                                        find_unused_parameters=True)
        seed = 1 + dist.get_rank()
    if compiled:  # 8 layers share one Layer.forward: leave room for per-layer specializations
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
    fwd = torch.compile(model) if compiled else model
    gen = torch.Generator(device=dev).manual_seed(seed)
    B, T, V = d["micro_batch"], d["seq"], d["vocab"]

    def step():
        tokens = torch.randint(0, V, (B, T), device=dev, generator=gen)
        targets = torch.randint(0, V, (B, T), device=dev, generator=gen)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            ce, counts = fwd(tokens, targets)
        ce.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ddp:  # every rank's biases move by the group's loads, so they stay identical
            total = torch.stack(counts)
            dist.all_reduce(total)
            counts = list(total.unbind(0))
        update_selection_bias(torch, core, counts, bias_rate)
        return ce, counts

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_start = time.time()
    for _ in range(warmup):
        step()
    sync()
    warm_s = time.time() - t_start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses, load_max, skip = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        ce, counts = step()
        losses.append(ce.item())  # syncs: the step is done
        times.append(time.perf_counter() - t0)
        load_max.append(max((c.max() / c.float().mean()).item() for c in counts))  # busiest / fair, worst layer
        if d["skip"]:
            skip.append(statistics.mean((c[-1] / c.sum()).item() for c in counts))
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    nparams = sum(p.numel() for p in core.parameters())
    del model, core, opt, fwd
    if cuda:
        torch.cuda.empty_cache()
    return {"tokens_per_s": B * T / statistics.median(times), "memory_gib": mem, "ce": losses,
            "load_max": load_max, "params": nparams, "warmup_s": warm_s,
            "busiest_over_fair": statistics.median(load_max), "skip_share": statistics.mean(skip) if skip else 0.0}


# ---------------------------------------------------------------------------------------------
# --parity: the PyTorch model against keel's CPU reference, on keel's own checkpoints
# ---------------------------------------------------------------------------------------------

def read_keel_checkpoint(step_dir):
    """{tensor name: float32 array} from a keel checkpoint step directory (docs/checkpoint.md)."""
    meta = json.load(open(os.path.join(step_dir, "metadata.json")))
    out = {}
    for t in meta["tensors"]:
        shape = tuple(t["shape"])
        dt = {"f32": np.float32, "f64": np.float64, "i64": np.int64, "i32": np.int32}[t["dtype"]]
        arr = np.zeros(shape, dtype=dt)
        for s in t["shards"]:
            with open(os.path.join(step_dir, s["file"]), "rb") as f:
                f.seek(s["byte_offset"])
                data = np.frombuffer(f.read(s["nbytes"]), dtype=dt).reshape(tuple(s["lengths"]))
            arr[tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["lengths"]))] = data
        out[t["name"]] = arr
    return out


def parity(keel, out, d, steps=8, muon=False, forced=False):
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    B, T, V = d["micro_batch"], d["seq"], d["vocab"]
    rng = np.random.default_rng(3)
    # Every document the same T tokens: keel's sampler cuts the packed stream into samples of
    # T + 1 starting at multiples of T, so every sample (and batch row) is this pattern + its
    # first token, whatever the shuffle.
    pattern = rng.integers(0, V, size=T, dtype=np.uint64)
    lr = 3e-3  # large enough that every parameter moves measurably in one step
    # A fast controller, so that the skip class (selection bias -1 at init) is chosen within a
    # few steps and its path (output 0) is checked too.
    rate = 0.25
    res = run_keel(keel, out, d, steps, 0, "cpu", rows=np.tile(pattern, (64, 1)), checkpoint_every=1, lr=lr,
                   bias_rate=rate, muon=muon, forced=forced)
    if "error" in res:
        print(res["error"])
        return False
    seq = np.concatenate([pattern, pattern[:1]]).astype(np.int64)
    tokens = torch.tensor(np.tile(seq[:-1], (B, 1)))
    targets = torch.tensor(np.tile(seq[1:], (B, 1)))
    model = build_torch_model(d, "cpu", torch.float32, forced)
    names = model.keel_params()
    nparams = sum(p.numel() for p in model.parameters())
    ok = nparams == res.get("params", nparams) == total_params(d)
    print(f"parity: parameters torch {nparams}, keel {res.get('params')}, formula {total_params(d)}"
          f"{'' if ok else '  MISMATCH'}")
    worst_ce, worst_upd, worst_bias = 0.0, (0.0, ""), 0.0

    def load(step):
        return read_keel_checkpoint(os.path.join(out, "ckpt", f"step_{step:08d}"))

    for j in range(1, steps):
        ck, nxt = load(j), load(j + 1)
        opt = Optimizer(torch, model, fused=False, lr=lr, muon=muon)
        with torch.no_grad():
            for name, (p, _) in names.items():
                p.copy_(torch.from_numpy(ck["model/" + name]).view_as(p))
            for m, layer in enumerate(model.layers):
                layer.sel_bias.copy_(torch.from_numpy(ck[f"router/bias.{m}"]))
        for name, (p, _) in names.items():
            m = torch.from_numpy(ck["optim/exp_avg/" + name].copy()).view_as(p).clone()
            if opt.muon and p in opt.muon.momentum:  # keel keeps Muon's momentum in AdamW's m
                opt.muon.momentum[p] = m
                continue
            opt.adamw.state[p] = {"step": torch.tensor(float(j)), "exp_avg": m,
                                  "exp_avg_sq": torch.from_numpy(ck["optim/exp_avg_sq/" + name].copy()).view_as(p).clone()}
        ce, counts = model(tokens, targets)
        ce.backward()
        for p in model.parameters():  # keel steps every parameter (an expert with no tokens: zero
            if p.grad is None:        # gradient, decay and momentum); torch.optim skips grad None
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_selection_bias(torch, model, counts, rate)
        dce = abs(ce.item() - res["ce"][j])
        worst_ce = max(worst_ce, dce)
        # Per tensor: |torch's update - keel's update| / |keel's update| (Frobenius).
        for name, (p, _) in names.items():
            before, after = ck["model/" + name].astype(np.float64), nxt["model/" + name].astype(np.float64)
            mine = p.detach().double().numpy().reshape(after.shape)
            den = np.linalg.norm(after - before)
            rel = np.linalg.norm(mine - after) / den if den > 0 else np.linalg.norm(mine - after)
            if rel > worst_upd[0]:
                worst_upd = (rel, f"{name} (step {j + 1})")
        for m, layer in enumerate(model.layers):
            worst_bias = max(worst_bias, float(np.abs(layer.sel_bias.numpy() - nxt[f"router/bias.{m}"]).max()))
        print(f"parity: step {j + 1}: ce keel {res['ce'][j]:.6f} torch {ce.item():.6f} (|diff| {dce:.2e}); "
              f"classes used per layer {[int((c > 0).sum()) for c in counts]}, skipped tokens per layer "
              f"{[int(c[-1]) for c in counts]}")
    print(f"parity: worst |ce diff| {worst_ce:.2e}; worst per-tensor update error {worst_upd[0]:.2e} "
          f"({worst_upd[1]}); worst selection-bias diff {worst_bias:.2e}")
    ok = ok and worst_ce < 1e-4 and worst_upd[0] < 1e-2 and worst_bias < 1e-6
    print("parity: " + ("OK" if ok else "FAILED"))
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", required=True, help="the keel binary")
    ap.add_argument("--out", required=True, help="output directory (dataset, config, logs, JSON)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (a CPU check of the config and model)")
    ap.add_argument("--parity", action="store_true", help="check the torch model against keel's CPU reference")
    ap.add_argument("--skip-keel", action="store_true")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--muon", action="store_true",
                    help="Muon on the weight matrices, AdamW on the rest, on both sides (ZAYA1's recipe)")
    ap.add_argument("--forced-balance", action="store_true",
                    help="benchmarking only: token n -> expert n mod E on both sides (keel: router.forced_balance)")
    ap.add_argument("--attention", choices=("cca", "gqa"), default="cca",
                    help="the attention of both sides' model (gqa: keel's GQA layer at the same widths; the "
                         "context-parallel peer's, bench/train_cp_torch.py)")
    ap.add_argument("--ablations", action="store_true",
                    help="also run keel with GQA attention instead of CCA, and without the skip class")
    args = ap.parse_args()
    d = dict(TINY if args.tiny else ZAYA8, attention=args.attention)
    if args.parity:
        if not (args.tiny and args.device == "cpu"):
            sys.exit("--parity needs --tiny --device cpu (keel's fp32 CPU reference)")
        sys.exit(0 if parity(args.keel, args.out, d, muon=args.muon, forced=args.forced_balance) else 1)
    fpt = flops_per_token(d)
    tokens_per_step = d["micro_batch"] * d["seq"]
    print(f"model: {d['layers']} x ({d['attention'].upper()} + MoE), hidden {d['hidden']}, {d['experts']} experts + skip, vocab "
          f"{d['vocab']}; {total_params(d) / 1e9:.3f} B parameters; {fpt / 1e9:.3f} GFLOP per token (model FLOPs)",
          flush=True)
    results = {}
    optimizer = "Muon + AdamW" if args.muon else "AdamW"
    json_path = os.path.join(args.out, "zaya_vs_torch.json")
    os.makedirs(args.out, exist_ok=True)

    def save():
        json.dump({"dims": d, "flops_per_token": fpt, "peak_flops": PEAK, "optimizer": optimizer, "results": results},
                  open(json_path, "w"), indent=1)

    if not args.skip_keel:
        t0 = time.time()
        results["keel"] = run_keel(args.keel, args.out, d, args.steps + args.warmup, args.warmup, args.device,
                                   muon=args.muon, forced=args.forced_balance)
        print(f"keel: {results['keel']} ({time.time() - t0:.0f} s)", flush=True)
        save()
    if args.ablations:  # where keel's time goes: the same model with one ZAYA1 piece swapped out
        for label, tag, change in (("keel, GQA attn", "keel-gqa", {"attention": "gqa"}),
                                   ("keel, no skip", "keel-noskip", {"skip": False})):
            dv = dict(d, name=d["name"] + "-" + tag, **change)
            t0 = time.time()
            results[label] = run_keel(args.keel, os.path.join(args.out, tag), dv, args.steps + args.warmup, args.warmup,
                                      args.device, muon=args.muon, forced=args.forced_balance)
            results[label]["flops_per_token"] = flops_per_token(dv)
            print(f"{label}: {results[label]} ({time.time() - t0:.0f} s)", flush=True)
            save()
    if not args.skip_torch:
        for name, compiled in (("torch eager", False), ("torch.compile", True)):
            if compiled and (args.skip_compile or args.device == "cpu"):
                continue
            t0 = time.time()
            try:
                results[name] = run_torch(d, args.steps, args.warmup, compiled, args.device, muon=args.muon,
                                          forced=args.forced_balance)
            except Exception as e:  # report and go on: the table shows what ran
                results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: {results[name]} ({time.time() - t0:.0f} s)", flush=True)
            save()
    dev_name, torch_ver = args.device, "?"
    try:
        import torch
        torch_ver = torch.__version__
        if args.device == "cuda":
            dev_name = torch.cuda.get_device_name(0)
    except Exception:  # no torch: keel alone
        pass
    print(f"\n== keel train vs PyTorch, ZAYA1-shaped model ({dev_name}, torch {torch_ver}; {d['layers']} x (CCA + "
          f"top-1 MoE of {d['experts']} experts + skip), hidden {d['hidden']}, vocab {d['vocab']}, seq {d['seq']}, "
          f"{tokens_per_step} tokens/step, {optimizer})")
    print(f"{'':16}{'tokens/s':>10}{'model TFLOP/s':>15}{'MFU':>8}{'peak GiB':>10}{'ce first':>10}{'ce last':>10}"
          f"{'busiest/fair':>14}{'skip':>7}")
    # the three compared runs first, then keel's ablations (keel only, each a different model)
    for name in sorted(results, key=lambda n: n.startswith("keel, ")):
        r = results[name]
        if "error" in r:
            print(f"{name:16}  {r['error']}")
            continue
        tf = r["tokens_per_s"] * r.get("flops_per_token", fpt)
        ce = r.get("ce") or [float("nan")]
        bf = r.get("busiest_over_fair", float("nan"))
        flag = "  NOT a headline: a class above 2x its share" if bf > 2 else ""
        print(f"{name:16}{r['tokens_per_s']:10.0f}{tf / 1e12:15.1f}{100 * tf / PEAK:7.2f}%{r['memory_gib']:10.1f}"
              f"{ce[0]:10.3f}{ce[-1]:10.3f}{bf:14.2f}{r.get('skip_share', float('nan')):7.3f}"
              f"{'   (ablation)' if name.startswith('keel, ') else ''}{flag}")
    k = results.get("keel", {})
    for name in ("torch eager", "torch.compile"):
        r = results.get(name, {})
        if "tokens_per_s" in k and "tokens_per_s" in r:
            mem = f", {k['memory_gib'] / r['memory_gib']:.2f}x peak memory" if r["memory_gib"] > 0 else ""
            print(f"keel / {name}: {k['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s{mem}")
    if "keel_mfu" in k:
        print(f"(keel's own MFU line: {100 * k['keel_mfu']:.2f}%; same formula and peak)")
    print(f"(routing: busiest/fair = the worst MoE layer's busiest class over its fair share 1/{d['experts'] + int(d['skip'])}, "
          f"median over the timed steps; skip = the skip class's share{'; forced balance' if args.forced_balance else ''})")


if __name__ == "__main__":
    main()

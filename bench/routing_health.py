#!/usr/bin/env python3
"""Routing health of keel train on the ZAYA1-shaped model, on real text (issue 36, part 4).

The model: bench/zaya_vs_torch.py's ZAYA1-shaped model (the first 8 layers of ZAYA1-8B: hidden
2048, CCA 8/2 heads of 128, MLP router of 256 with EDA, 16 SwiGLU experts of 2048 + the skip
class, vocabulary 262,272), sequence 4096, 2 sequences = 8,192 tokens per step, bf16 on one GPU,
AdamW at lr 3e-4 (constant unless a variant sets schedule.* keys), no aux loss. Data: the
shipped corpus (data/corpus/*.jsonl) and any --text files (plain text, cut into ~2 KB documents
at blank lines; e.g. tinyshakespeare, wikitext-2) through keel's byte tokenizer: real text; the
shipped corpus alone is small and read many times over.

Runs, the same data and seed:
  before:  router.init_gain 0 (every matrix normal(0, 0.02): the router's logits start ~1e-3, so
           the selection bias alone routes every token) and the sign controller at rate 0.01:
           keel train until this change;
  after:   keel train's defaults (router.init_gain 1: the router MLP normal(0, 1/sqrt(fan_in)))
           with the same controller;
  after-proportional: the defaults with router.balance proportional, rate 0.1.
Each run reports, after step --after: the worst per-layer busiest class over its fair share
(1/17, skip included), its mean, the share of steps with a layer above 2x, the same worst over
windows of 10 steps' summed counts (router.log_counts: the balance the controller holds apart
from one step's sampling of a few documents), the mean skip share, the loss (mean of the last 5 steps) and the loss at
steps 10/25/50, tokens/s and MFU (median over steps 5..end). Table last; JSON to OUT/routing.json.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zaya_vs_torch import ZAYA8, TINY, keel_config  # noqa: E402

VARIANTS = {
    "before": ["--set", "router.init_gain=0", "--set", "router.balance=sign", "--set", "router.bias_update_rate=0.01"],
    "after": ["--set", "router.balance=sign", "--set", "router.bias_update_rate=0.01"],
    "after-proportional": ["--set", "router.balance=proportional", "--set", "router.bias_update_rate=0.1"],
}


def variant_args(v):
    """A named variant, or RULE:RATE[:GAIN[:LR_SCALE[:KEY=VALUE...]]] (router.balance,
    router.bias_update_rate, router.init_gain, router.lr_scale, then any keel train --set, e.g.
    schedule.warmup_steps=50)."""
    if v in VARIANTS:
        return VARIANTS[v]
    rule, rate, *more = v.split(":")
    args = ["--set", f"router.balance={rule}", "--set", f"router.bias_update_rate={rate}"]
    for key, value in zip(("init_gain", "lr_scale"), more[:2]):
        args += ["--set", f"router.{key}={value}"]
    for kv in more[2:]:
        args += ["--set", kv]
    return args


def text_documents(path, size=2000):
    """A plain-text file as documents of about `size` characters, cut at blank lines."""
    docs, cur = [], ""
    for para in re.split(r"\n[ \t]*\n", open(path, encoding="utf-8").read()):
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= size:
            docs.append(cur)
            cur = ""
    return docs + ([cur] if cur else [])


def tokenize(keel, src, out, texts):
    """The shipped corpus plus any --text files, one JSONL, byte-tokenized; returns (prefix, bytes)."""
    prefix = os.path.join(out, "corpus")
    docs = os.path.join(out, "corpus.jsonl")
    with open(docs, "w") as f:
        for name in ("stories.jsonl", "arithmetic.jsonl"):
            f.write(open(os.path.join(src, "data/corpus", name)).read())
        for t in texts:
            for d in text_documents(t):
                f.write(json.dumps({"text": d}) + "\n")
    subprocess.run([keel, "data", "tokenize", docs, "--out", prefix, "--append-eos", "--force"], check=True,
                   stdout=subprocess.DEVNULL)
    return prefix, os.path.getsize(prefix + ".bin")


def run(keel, d, prefix, out, steps, device, extra):
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = os.path.join(out, "train.yaml")
    with open(cfg, "w") as f:
        f.write(keel_config(d, prefix, out, steps, device))
    r = subprocess.run([keel, "train", cfg, "--set", "router.log_counts=true", *extra], capture_output=True, text=True)
    open(os.path.join(out, "train.log"), "w").write(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"keel train failed ({r.returncode}): {(r.stdout + r.stderr)[-3000:]}")
    rows = [json.loads(l) for l in open(os.path.join(out, "run", "metrics.jsonl"))]
    counts = {r["step"]: r["routing_counts"] for r in rows if "routing_counts" in r}
    return [dict(r, counts=counts.get(r["step"])) for r in rows if "loss" in r]


def window_busiest(rows, classes, after, width):
    """The worst layer's busiest class over its fair share with each layer's counts summed over
    windows of `width` steps after step `after` (what the controller holds on average, apart from
    the sampling of one step's few documents): the windows' worst and mean."""
    late = [r["counts"] for r in rows if r["step"] > after and r.get("counts")]
    out = []
    for w in range(0, len(late) - width + 1, width):
        layers = [[sum(step[l][c] for step in late[w:w + width]) for c in range(len(late[w][l]))]
                  for l in range(len(late[w]))]
        out.append(max(max(l) / sum(l) * classes for l in layers if sum(l) > 0))
    return (max(out), statistics.mean(out)) if out else (None, None)


def summarize(rows, classes, after):
    late = [r for r in rows if r["step"] > after]
    busiest = lambda r: max(r[k] for k in r if k.startswith("routing_busiest_share.")) * classes
    skip = lambda r: statistics.mean(r[k] for k in r if k.startswith("routing_skip_share."))
    per_layer = sorted(k for k in rows[0] if k.startswith("routing_busiest_share."))
    at = {r["step"]: r["ce"] for r in rows}
    timed = [r for r in rows if r["step"] >= 5]
    w_worst, w_mean = window_busiest(rows, classes, after, 10)
    return {
        "window10_busiest_over_fair_worst_after": w_worst,
        "window10_busiest_over_fair_mean_after": w_mean,
        "worst_busiest_over_fair_after": max(busiest(r) for r in late),
        "mean_busiest_over_fair_after": statistics.mean(busiest(r) for r in late),
        "share_of_steps_over_2x_after": sum(busiest(r) > 2 for r in late) / len(late),
        "per_layer_worst_after": [max(r[k] for r in late) * classes for k in per_layer],
        "mean_skip_share_after": statistics.mean(skip(r) for r in late),
        "ce_at": {s: at.get(s) for s in (1, 10, 25, 50)},
        "ce_final": statistics.mean(r["ce"] for r in rows[-5:]),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--after", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (a CPU check of this script)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default: the model's)")
    ap.add_argument("--mid", action="store_true",
                    help="a CPU-sized cut with ZAYA1's routing: 16 experts + skip, hidden 256, 4 layers, 16 x 512 = "
                         "8,192 tokens per step (the GPU runs' count), byte vocabulary")
    ap.add_argument("--text", action="append", default=[],
                    help="a plain-text file added to the corpus (cut into ~2 KB documents); repeatable")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list: before, after, after-proportional, or RULE:RATE[:INIT_GAIN[:LR_SCALE[:KEY=VALUE...]]]")
    a = ap.parse_args()
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = dict(TINY if a.tiny else ZAYA8)
    if a.mid:
        d = dict(TINY, name="zaya1-mid-cpu", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=16,
                 expert_hidden=512, router_hidden=64, seq=512, micro_batch=16)
    if a.seq:
        d["seq"] = a.seq
    if a.micro_batch:
        d["micro_batch"] = a.micro_batch
    os.makedirs(a.out, exist_ok=True)
    prefix, corpus_bytes = tokenize(a.keel, src, a.out, a.text)
    classes = d["experts"] + (1 if d["skip"] else 0)
    results = {}
    for v in a.variants.split(","):
        rows = run(a.keel, d, prefix, os.path.join(a.out, v), a.steps, a.device, variant_args(v))
        results[v] = summarize(rows, classes, a.after)
        print(f"{v}: {json.dumps(results[v])}", flush=True)
    json.dump({"model": d["name"], "steps": a.steps, "after": a.after, "texts": a.text, "results": results},
              open(os.path.join(a.out, "routing.json"), "w"), indent=1)
    print(f"\n== routing health: {d['name']}, {a.steps} steps of {d['seq'] * d['micro_batch']} tokens, real text "
          f"(byte-tokenized data/corpus{''.join(' + ' + os.path.basename(t) for t in a.text)}, "
          f"{corpus_bytes / 2e6:.2f} M tokens), {a.device}; after step {a.after}:")
    print(f"{'variant':20s} {'busiest/fair worst':>18s} {'mean':>6s} {'>2x':>5s} {'10-step worst':>13s} {'skip':>6s} "
          f"{'ce@10':>7s} {'ce@25':>7s} {'ce@50':>7s} {'ce end':>7s} {'tok/s':>8s} {'MFU':>6s}")
    for v, r in results.items():
        c = r["ce_at"]
        f = lambda x: f"{x:7.3f}" if x is not None else "      -"
        w10 = r["window10_busiest_over_fair_worst_after"]
        print(f"{v:20s} {r['worst_busiest_over_fair_after']:18.2f} {r['mean_busiest_over_fair_after']:6.2f} {r['share_of_steps_over_2x_after']:5.2f} "
              f"{w10 if w10 is not None else float('nan'):13.2f} {r['mean_skip_share_after']:6.3f} {f(c[10])} {f(c[25])} {f(c[50])} {r['ce_final']:7.3f} "
              f"{r['tokens_per_s']:8.0f} {100 * r['mfu']:5.1f}%")


if __name__ == "__main__":
    main()

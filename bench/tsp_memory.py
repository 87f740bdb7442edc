#!/usr/bin/env python3
"""Per-rank memory (and with --steps, tokens/s) of keel train's two-rank layouts: TSP=2 against
TP=2, TP=2+SP, CP=2 and DP=2, as sequences grow (issue 30's comparison), on CPU ranks or on GPUs.
--degree D: the same layouts on D ranks (TSP=D, TP=D, TP=D+SP, CP=D, DP=D).

Model: a dense decoder of the TSP paper's 7B proportions (hidden --hidden, heads of 128, FFN x4,
--layers layers, vocabulary 32,000; on CPU ranks the hidden is scaled down), one sequence per
micro-batch, AdamW. --model zaya1: bench/zaya_vs_torch.py's ZAYA1-shaped model instead (the
8-layer cut of ZAYA1-8B: CCA 8/2 heads of 128, MLP router with EDA and the skip class, 16
experts of 2,048 top-1, vocabulary 262,272 tied; --tiny: its toy sizes, for CPU ranks), with
forced-balance routing (router.forced_balance: every expert an equal share, never skip) so the
tokens/s of every layout time balanced experts. For each layout and sequence length it starts `mpirun -np D keel train`
(--device cpu or cuda) on random tokens, reads rank 0's start-up memory line (keel's own
allocations, sized before the first step) and stops the run: no step is timed. With --steps N
(N > 3) it trains N steps instead and also prints the median tokens/s per GPU over the steps
after 2 (a throughput figure only on a GPU per rank). With --size it also prints `keel size`'s
prediction for the same layout.
On a machine with one GPU, KEEL_NCCL_OVER_MPI=1 lets both ranks share it (the collectives go
through MPI; both ranks' memory must then fit on the one GPU). Writes OUT/tsp_memory.json and
prints the table last.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_torch import write_dataset  # noqa: E402

KINDS = ["TSP", "TP", "TP+SP", "CP", "DP"]


def kind(layout):
    """A layout's kind: "TP=4+SP" -> "TP+SP"."""
    return re.sub(r"=[0-9]+", "", layout)


def layout_name(k, degree):
    return f"TP={degree}+SP" if k == "TP+SP" else f"{k}={degree}"


def parallel(k, degree):
    """parallel: keys of a layout kind at `degree` (data for DP)."""
    return {"TSP": {"tsp": degree}, "TP": {"tensor": degree}, "TP+SP": {"tensor": degree, "sequence": "true"},
            "CP": {"context": degree}, "DP": {"data": degree}}[k]


def parallel_keys(a, k):
    """parallel: keys of a run: its layout's, --tsp-tables for TSP, --context-mode for TSP and CP."""
    keys = dict(parallel(k, a.degree))
    if k == "TSP" and a.tsp_tables:
        keys["tsp_tables"] = a.tsp_tables
    if k in ("TSP", "CP") and a.context_mode:
        keys["context_mode"] = a.context_mode
    return keys


def model_text(a, seq):
    return f"""name: dense-7b-shape
vocab_size: 32000
hidden: {a.hidden}
layers: {a.layers}
attention: mha
heads: {a.hidden // 128}
kv_heads: {a.hidden // 128}
head_dim: 128
ffn_hidden: {4 * a.hidden}
max_seq_len: {seq}
"""


def zaya_dims(a, seq):
    import zaya_vs_torch
    d = dict(zaya_vs_torch.TINY if a.tiny else zaya_vs_torch.ZAYA8, seq=seq, micro_batch=1)
    if a.layers:
        d["layers"] = a.layers
    return d


def zaya_config(a, prefix, out, seq, layout):
    import train_tp_vs_torch
    import zaya_vs_torch
    k = kind(layout)
    accum = a.degree if k == "DP" else 1  # the same tokens per GPU: a micro-batch on each rank
    text, _ = train_tp_vs_torch.keel_config("zaya1", zaya_dims(a, seq), prefix, out, max(1, a.steps), a.device, accum,
                                            parallel_keys(a, k), 3e-5, zaya_vs_torch.BIAS_RATE, forced=True)
    return text


def config(a, prefix, out, seq, layout):
    if a.model == "zaya1":
        return zaya_config(a, prefix, out, seq, layout)
    k = kind(layout)
    accum = a.degree if k == "DP" else 1
    keys = "".join(f"  {key}: {v}\n" for key, v in parallel_keys(a, k).items() if key != "data")
    model = "".join("  " + line + "\n" for line in model_text(a, seq).splitlines())
    return f"""device: {a.device}
model:
{model}data:
  datasets: {{train: {prefix}}}
  seq_length: {seq}
parallel:
  data: {a.degree if k == "DP" else 1}
{keys}batch:
  micro_batch: 1
  grad_accum: {accum}
optimizer:
  lr: 0.0001
steps: {max(1, a.steps)}
output_dir: {out}
checkpoint: {{final: false}}
"""


def gib(text):
    return float(text.split()[0])


def measure(a, prefix, seq, layout):
    run_dir = os.path.join(a.out, f"{layout.replace('=', '').replace('+', '_')}_{seq}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cfg = os.path.join(run_dir, "train.yaml")
    text = config(a, prefix, os.path.join(run_dir, "run"), seq, layout)
    if a.profile:  # kernels.profile: the step's phases (CUDA events), printed by keel train at its end
        text = text.replace("\nkernels:\n", "\nkernels:\n  profile: true\n") if "\nkernels:\n" in text \
            else text + "kernels:\n  profile: true\n"
    open(cfg, "w").write(text)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [a.mpirun, "--oversubscribe", "--bind-to", "none", "-n", str(a.degree)]
    for k in os.environ:
        if k.startswith("KEEL_") or k.startswith("NCCL_"):
            cmd += ["-x", k]
    p = subprocess.Popen(cmd + [a.keel, "train", cfg],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line, seen, rates = None, [], []
    for out in p.stdout:
        seen.append(out)
        if out.startswith("memory on this rank:"):
            line = out.strip()
            if a.steps <= 1:
                break
        m = re.search(r"\| ([0-9]+) tok/s \|", out)
        if m and out.startswith("step"):
            rates.append(float(m.group(1)))
    p.kill()
    p.wait()
    open(os.path.join(run_dir, "keel.log"), "w").write("".join(seen))
    if not line:
        errors = [x for x in seen if "error" in x]
        return {"error": (errors[0] if errors else "".join(seen[-5:])).strip()}
    row = {}
    if a.profile:
        start = next((i for i, x in enumerate(seen) if x.startswith("step profile")), None)
        if start is not None:
            end = next((i for i in range(start + 1, len(seen)) if re.match(r"  step ", seen[i])), len(seen) - 1)
            row["profile"] = "".join(seen[start:end + 1])
    total, parts = line.split(" = ", 1)
    row["total_gib"] = gib(total.split(": ")[1])
    for part in parts.split(" + "):
        m = re.match(r"(.+) ([0-9.]+ GiB)$", part)
        if m:
            row[m.group(1)] = gib(m.group(2))
    if a.size:
        row["keel size"] = predicted(a, run_dir, seq, layout)
    timed = rates[2:]  # the first two steps warm up
    if timed:
        row["tokens/s per GPU"] = float(np.median(timed)) / a.degree
    elif a.steps > 1:
        row["error"] = "no timed step: " + "".join(seen[-3:]).strip()
    return row


def size_layout(layout, degree):
    """keel size --layout words of a layout."""
    return {"TSP": [f"tsp={degree}"], "TP": [f"tp={degree}", "--no-sequence-parallel"], "TP+SP": [f"tp={degree}"],
            "CP": [f"cp={degree}"], "DP": ["zero=1"]}[kind(layout)]


def predicted(a, run_dir, seq, layout):
    """keel size's per-GPU total for the same model and layout (GiB), or None."""
    model = os.path.join(run_dir, "model.yaml")
    if a.model == "zaya1":  # the training config's model section, unindented
        lines = open(os.path.join(run_dir, "train.yaml")).read().split("\nmodel:\n", 1)[1].splitlines()
        text = "".join(line[2:] + "\n" for line in lines[:next(i for i, x in enumerate(lines) if not x.startswith("  "))])
    else:
        text = model_text(a, seq)
    open(model, "w").write(text)
    js = os.path.join(run_dir, "size.json")
    extra = ["--tsp-tables", a.tsp_tables] if a.tsp_tables and kind(layout) == "TSP" else []
    if a.context_mode and kind(layout) in ("TSP", "CP"):
        extra += ["--context-mode", a.context_mode]
    # the run's cross-entropy chunk (the ZAYA1-shaped config's is 32768; keel size's default 8192)
    chunk = re.search(r"^ce_chunk: ([0-9]+)$", open(os.path.join(run_dir, "train.yaml")).read(), re.M)
    if chunk:
        extra += ["--ce-chunk", chunk.group(1)]
    r = subprocess.run([a.keel, "size", model, "--layout", *size_layout(layout, a.degree), *extra, "--gpus", str(a.degree),
                        "--seq", str(seq),
                        "--hardware", "h200", "--json", js], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    mem = json.load(open(js)).get("memory", {})
    total = mem.get("total_bytes")
    return round(total / 2**30, 2) if total else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--out", default="out/bench_tsp_memory")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden width (heads of 128; the 7B's is 4096)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: 2 for the dense model, 8 for zaya1)")
    ap.add_argument("--model", choices=["dense", "zaya1"], default="dense")
    ap.add_argument("--tiny", action="store_true", help="zaya1 at toy sizes (CPU ranks)")
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--layouts", default=",".join(KINDS), help=f"a comma list of {', '.join(KINDS)} (TSP=2 etc. too)")
    ap.add_argument("--degree", type=int, default=2, help="ranks of every layout (TSP=D, TP=D, ...)")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", action="store_true", help="also print keel size's prediction (GPU layouts)")
    ap.add_argument("--steps", type=int, default=1,
                    help="steps per run: above 3, also the median tokens/s per GPU over the steps after 2")
    ap.add_argument("--tsp-tables", choices=["auto", "sweep", "gather"], default=None,
                    help="TSP layouts: parallel.tsp_tables (default: keel train's, auto)")
    ap.add_argument("--context-mode", choices=["allgather", "ring"], default=None,
                    help="TSP and CP layouts: parallel.context_mode (default: keel train's)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU: also train with kernels.profile and print each run's step phases (with --steps)")
    a = ap.parse_args()
    if a.model == "dense" and a.layers is None:
        a.layers = 2
    os.makedirs(a.out, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",")]
    layouts = [layout_name(kind(x.strip()), a.degree) for x in a.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if kind(x) not in KINDS]
    if bad or a.degree < 2:
        ap.error(f"--layouts: {bad} not of {', '.join(KINDS)}" if bad else "--degree: at least 2")
    prefix = os.path.join(a.out, "random")
    rng = np.random.default_rng(0)
    vocab = zaya_dims(a, 1)["vocab"] if a.model == "zaya1" else 32000
    write_dataset(prefix, rng.integers(0, min(vocab, 32000), size=4 * (max(lengths) + 1), dtype=np.uint64),
                  max(lengths))
    results = {}
    for seq in lengths:
        for layout in layouts:
            results[f"{layout} {seq}"] = r = measure(a, prefix, seq, layout)
            print(f"{layout:8s} {seq:6d}: { {k: v for k, v in r.items() if k != 'profile'} }", flush=True)
    json.dump(results, open(os.path.join(a.out, "tsp_memory.json"), "w"), indent=1)
    where = f"{a.degree} CPU ranks (GiB, rank 0's arenas, fp32)" if a.device == "cpu" else \
        f"{a.degree} GPU ranks (GiB, rank 0's allocations: bf16 GEMM operands, fp32 masters/grads/optimizer)"
    if a.model == "zaya1":
        d = zaya_dims(a, lengths[-1])
        what = (f"ZAYA1-shaped{' (tiny)' if a.tiny else ''}, h={d['hidden']}, {d['layers']} layers of CCA + "
                f"{d['experts']} experts, vocab {d['vocab']}, forced-balance routing")
    else:
        what = f"dense h={a.hidden}, {a.layers} layers, FFN x4, vocab 32000"
    print(f"\n== keel train per-rank memory on {where}: {what}, one sequence per micro-batch")
    if a.device == "cpu":
        groups = {"params": ["parameters"], "grads": ["gradients"], "optim": ["optimizer state"],
                  "acts": ["activations and scratch"], "shards": ["tsp shards"]}
    else:
        groups = {"weights": ["fp32 master weights", "bf16 weights"], "grads": ["fp32 gradients"],
                  "optim": ["optimizer m (Muon momentum)", "AdamW v"],
                  "acts": ["saved activations", "backward scratch", "cross-entropy (kept logits)"],
                  "comm": ["sequence-parallel gathers", "context-parallel k/v gathers",
                           "context-parallel ring blocks", "context-parallel all-to-all buffers", "tsp shards",
                           "expert-parallel exchange", "bf16 gradient-reduce scratch"]}
    print(f"{'layout':8s} " + " ".join(f"{s:>8d}" for s in lengths) +
          f"   (at the longest: {' / '.join(groups)})" + ("   keel size at each length" if a.size else ""))
    for layout in layouts:
        cells, last, sizes = [], {}, []
        for seq in lengths:
            r = results[f"{layout} {seq}"]
            cells.append(f"{r['total_gib']:8.2f}" if "total_gib" in r else f"{'error':>8s}")
            sizes.append(f"{r['keel size']:.2f}" if r.get("keel size") else "-")
            if "total_gib" in r:
                last = r
        detail = " / ".join(f"{sum(last.get(k, 0) for k in keys):.2f}" for keys in groups.values())
        print(f"{layout:8s} " + " ".join(cells) + "   " + detail + ("   " + " ".join(sizes) if a.size else ""))
    lowest = {seq: min((results[f"{l} {seq}"].get("total_gib", 1e9), l) for l in layouts)[1] for seq in lengths}
    print("lowest: " + ", ".join(f"{seq}: {l}" for seq, l in lowest.items()))
    if a.steps > 3:
        print(f"\n== keel train tokens/s per GPU (median of the steps after 2 of {a.steps}; same layouts)")
        print(f"{'layout':8s} " + " ".join(f"{s:>8d}" for s in lengths))
        for layout in layouts:
            cells = []
            for seq in lengths:
                r = results[f"{layout} {seq}"]
                cells.append(f"{r['tokens/s per GPU']:8.0f}" if "tokens/s per GPU" in r else f"{'-':>8s}")
            print(f"{layout:8s} " + " ".join(cells))
    for k, r in results.items():
        if r.get("profile"):
            print(f"\n== {k}: rank 0's {r['profile']}", end="")
    for k, r in results.items():
        if "error" in r:
            print(f"{k}: {r['error'][:200]}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Two keel binaries side by side on the same training runs: throughput before and after a change.

For the engine restructure (issue 27) the two builds are the commit before it and the change;
any two `keel` binaries work. Each case trains the same config with both, alternately (A B,
then B A, ...), `--runs` times each, on the same GPUs, and reports each side's median tokens/s
over the timed steps (after `--warmup`) of each run, the median of those over the runs, and the
ratio B / A. The runs are the same computation, so their losses must agree too (printed).

Cases (all `device: cuda`, AdamW, 8K tokens per GPU per step, on a uint32 dataset this script
writes: `--data text` (the default) cuts rows of seq + 1 byte tokens at random offsets from
keel's demo corpus (data/corpus/*.txt), so the router sees text's skewed token statistics;
`--data random` draws uniform-random tokens over the whole vocabulary):
  zaya1   the ZAYA1-shaped model of bench/zaya_vs_torch.py (the 8-layer cut of ZAYA1-8B: CCA,
          the MLP router with EDA and the skip class, residual scaling), one GPU, with lr 3e-5
          and keel's balancing-bias controller at rate 0.05 (the EP benchmark's balanced
          settings; --zaya-settings own: that script's lr 3e-4 and rate 0.01)
  bench   the bench model of bench/train_vs_torch.py (gqa attention, a softmax top-1 router over
          16 experts), one GPU, with the aux loss and bias balancing (rate 0.05, lr 3e-5: the
          EP benchmark's settings, under which the router does not collapse)
  dp2     the bench model under data parallelism (ZeRO-1, the overlapped step) on 2 GPUs, with
          the same settings, 2 micro-batches per step (one per GPU)

Every figure states its routing: the largest share of a MoE layer's routed slots one class took
(busiest) and the largest share the skip class took, over the layers, medians over the timed
steps (keel train's routing_busiest_share / routing_skip_share; a binary that does not log them
prints '-'). Balanced routing over 16 experts is 1/16 = 0.0625; 1.0 is a collapsed router.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_vs_torch  # noqa: E402
import zaya_vs_torch  # noqa: E402


def config_text(case, prefix, out, steps, zaya_settings):
    if case == "zaya1":
        text = zaya_vs_torch.keel_config(zaya_vs_torch.ZAYA8, prefix, out, steps, "cuda")
        if zaya_settings == "own":
            return text
        text = text.replace("bias_update_rate: 0.01", "bias_update_rate: 0.05")
        return "\n".join("  lr: 3e-05" if line.startswith("  lr: ") else line for line in text.split("\n"))
    d = train_vs_torch.DIMS
    text = train_vs_torch.keel_config(d, prefix, os.path.join(out, "run"), steps, grad_accum=2 if case == "dp2" else 1)
    text = text.replace("\nrouter:\n", "\nrouter:\n  bias_update_rate: 0.05\n")
    return "\n".join("  lr: 3e-05" if line.startswith("  lr: ") else line for line in text.split("\n"))


CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "corpus")


def token_rows(data, rng, n, length, vocab):
    """n rows of `length` tokens: windows of the demo corpus's bytes, or uniform-random ids."""
    if data == "random":
        return rng.integers(0, vocab, size=(n, length), dtype=np.uint64)
    text = b"".join(open(os.path.join(CORPUS, f), "rb").read() for f in ("stories.txt", "arithmetic.txt"))
    text = np.frombuffer(text * (length // len(text) + 2), dtype=np.uint8)
    starts = rng.integers(0, len(text) - length, size=n)
    return np.stack([text[s:s + length] for s in starts]).astype(np.uint64)


def dataset(case, out, steps, data):
    prefix = os.path.join(out, f"{data}_{case}")
    if os.path.exists(prefix + ".bin"):
        return prefix
    rng = np.random.default_rng(0)
    if case == "zaya1":
        d = zaya_vs_torch.ZAYA8
        zaya_vs_torch.write_dataset(prefix, token_rows(data, rng, d["micro_batch"] * (steps + 4), d["seq"] + 1, d["vocab"]))
    else:
        d = train_vs_torch.DIMS
        n = d["micro_batch"] * 2 * (steps + 4)
        train_vs_torch.write_dataset(prefix, token_rows(data, rng, n, d["seq"] + 1, d["vocab"]).reshape(-1), d["seq"])
    return prefix


def run(keel, case, out, tag, steps, warmup, timeout, data, zaya_settings):
    run_dir = os.path.join(out, f"{case}_{tag}")
    shutil.rmtree(run_dir, ignore_errors=True)  # keel train refuses another run's metrics
    os.makedirs(run_dir)
    path = os.path.join(run_dir, "train.yaml")
    open(path, "w").write(config_text(case, dataset(case, out, steps, data), run_dir, steps, zaya_settings))
    cmd = [keel, "train", path]
    if case == "dp2":
        cmd = ["mpirun", "--allow-run-as-root", "-np", "2", "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE"] + cmd
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    log = os.path.join(run_dir, "keel_train.log")
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    if r.returncode != 0:
        print(open(log).read()[-2000:])
        return {"error": f"exit {r.returncode}"}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "run", "metrics.jsonl"))]
    timed = [row for row in rows if "tokens_per_s" in row and row.get("step", 0) > warmup]

    def med(key):
        vals = [row[key] for row in timed if key in row]
        return statistics.median(vals) if vals else None

    return {"tokens_per_s": med("tokens_per_s"), "ce_last": [row["ce"] for row in rows if "ce" in row][-1],
            "busiest": med("routing_busiest_share"), "skip": med("routing_skip_share"),
            "load_max": med("expert_load_max")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="the baseline keel binary")
    ap.add_argument("--b", required=True, help="the changed keel binary")
    ap.add_argument("--out", default="out/engine_ab")
    ap.add_argument("--cases", default="zaya1,bench,dp2")
    ap.add_argument("--data", choices=("text", "random"), default="text")
    ap.add_argument("--zaya-settings", choices=("balanced", "own"), default="balanced",
                    help="zaya1's lr and bias rate: 3e-5 and 0.05 as the other cases (default), or "
                         "bench/zaya_vs_torch.py's own 3e-4 and 0.01 (its router collapses within 3 steps)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    results = {}
    for case in a.cases.split(","):
        res = {"A": [], "B": []}
        for i in range(a.runs):
            for side in (("A", "B") if i % 2 == 0 else ("B", "A")):
                r = run(a.a if side == "A" else a.b, case, a.out, f"{side}{i}", a.steps, a.warmup, a.timeout, a.data,
                        a.zaya_settings)
                res[side].append(r)
                print(f"{case} {side}{i}: {r}", flush=True)
        results[case] = res
    json.dump(results, open(os.path.join(a.out, "engine_ab.json"), "w"), indent=1)

    def med_of(runs, key):  # the median over runs of each run's median over its timed steps
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def fmt(x, f="{:.4f}"):
        return "-" if x is None else f.format(x)

    print(f"\n== keel A (baseline) vs B (change), {a.data} tokens, zaya1 {a.zaya_settings} settings: tokens/s, median of each run's timed steps; median of runs")
    print(f"{'case':7} {'A tok/s (runs)':>34} {'B tok/s (runs)':>34} {'B/A':>7} {'ce A':>8} {'ce B':>8} "
          f"{'busiest':>8} {'skip':>6}")
    for case, res in results.items():
        if any("error" in r for r in res["A"] + res["B"]):
            print(f"{case:7} error: " + "; ".join(r.get("error", "") for r in res["A"] + res["B"] if "error" in r))
            continue
        ta = [r["tokens_per_s"] for r in res["A"]]
        tb = [r["tokens_per_s"] for r in res["B"]]
        ma, mb = statistics.median(ta), statistics.median(tb)
        runs_a = "/".join(f"{t:.0f}" for t in ta)
        runs_b = "/".join(f"{t:.0f}" for t in tb)
        print(f"{case:7} {ma:9.0f} ({runs_a:>22}) {mb:9.0f} ({runs_b:>22}) {mb / ma:7.4f} "
              f"{fmt(res['A'][0]['ce_last']):>8} {fmt(res['B'][0]['ce_last']):>8} "
              f"{fmt(med_of(res['B'], 'busiest'), '{:.3f}'):>8} {fmt(med_of(res['B'], 'skip'), '{:.3f}'):>6}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Routing health of keel train on real text (issue 36, part 4).

Trains the tiny ZAYA1 (configs/train/zaya1-tiny.yaml: 4 experts + the skip class) on the story
corpus three times and reads the per-layer routing shares from metrics.jsonl:
  1. keel train's defaults for ZAYA1's MLP router (fan-in router init, proportional control of
     the balancing biases at 0.05, the router at a fiftieth of the lr; the config states them): at
     every step after step 50 every MoE layer's busiest class is under 2x its fair share (1/5),
     the skip class is in use (the controller raises it from its -1 start), and the final loss
     is below the other two runs';
  2. the controller keel train used before (sign at 0.01, the router at the full lr): a layer
     goes over 2x after step 50;
  3. router.init_gain 0 on top of 2 (every matrix normal(0, 0.02), the old init): the router's
     logits are ~1e-3, the bias decides every token, and a layer sits near one class (average
     above 3x).
Runs 2 and 3 show the checks can fail.
Usage: check_routing.py KEEL STORIES_PREFIX OUT_DIR.
"""
import json
import os
import shutil
import subprocess
import sys

STEPS, AFTER, CLASSES = 100, 50, 5


def run(keel, src, stories, out, *extra):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [keel, "train", os.path.join(src, "configs/train/zaya1-tiny.yaml"), "--set", "device=cpu",
           "--set", f"data.datasets.stories={stories}", "--set", f"steps={STEPS}", "--set", "log_interval=1",
           "--set", f"eval.prefix={stories}_heldout", "--set", "eval.interval=0", "--set", "checkpoint.interval=0", "--set", f"output_dir={out}",
           "--set", "checkpoint.final=false", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"keel train failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
    worst, skip = [], []
    for row in rows:
        if row["step"] <= AFTER:
            continue
        layers = sorted(k for k in row if k.startswith("routing_busiest_share."))
        if not layers:
            sys.exit("metrics.jsonl has no per-layer routing_busiest_share.<i>")
        worst.append(max(row[k] for k in layers) * CLASSES)
        skip.append(max(row[k] for k in row if k.startswith("routing_skip_share.")))
    final = sum(r["ce"] for r in rows[-10:]) / 10
    return sum(worst) / len(worst), max(worst), sum(skip) / len(skip), final


def main():
    keel, stories, out = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    good = run(keel, src, stories, out + "_default")
    sign = ("--set", "router.balance=sign", "--set", "router.bias_update_rate=0.01", "--set", "router.lr_scale=1")
    prev = run(keel, src, stories, out + "_sign", *sign)
    old = run(keel, src, stories, out + "_old_init", *sign, "--set", "router.init_gain=0")
    for name, r in (("defaults", good), ("sign 0.01", prev), ("init_gain 0", old)):
        print(f"{name:12s} after step {AFTER}: busiest/fair of the worst layer mean {r[0]:.2f} max {r[1]:.2f}, "
              f"mean skip share {r[2]:.3f}, final ce {r[3]:.4f}")
    checks = [(good[1] < 2.0, "with the defaults a layer's busiest class reached 2x its fair share after step 50"),
              (good[2] > 0.05, "the skip class is unused with the defaults"),
              (good[3] < prev[3], "the defaults' final loss is not below the sign controller's"),
              (good[3] < old[3], "the defaults' final loss is not below the old init's"),
              (prev[1] >= 2.0, "the sign controller stayed under 2x: this test no longer tells them apart"),
              (old[0] > 3.0, "the old init did not collapse: this test no longer tells them apart")]
    ok = True
    for passed, what in checks:
        if not passed:
            print("FAIL:", what)
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

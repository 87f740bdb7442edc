#!/usr/bin/env python3
"""keel eval's command-line checks (tests/eval/cli_tests.cmake).

  eval_check.py agree KEEL RUN_DIR [keel eval flags...]
      For every step directory of RUN_DIR whose step has an `eval_loss` in RUN_DIR/metrics.jsonl
      (keel train's eval), runs `keel eval STEP_DIR` (keel train's eval samples) and requires
      its "mean CE" to equal that eval_loss to 1e-4 relative. Needs two or more such steps, so a
      command that ignored the checkpoint could not pass.
  eval_check.py logprobs KEEL CKPT PREFIX OUT
      Runs `keel eval CKPT --data PREFIX --device cpu --logprobs OUT --top-k 3` and requires the
      mean of -logprob over OUT's rows to equal the printed CE (1e-4 relative), one row per
      scored token, and each row's target log-probability to be at most its top-1's.
  eval_check.py bad-vocab PREFIX ID [TOKENS]
      Writes an indexed dataset PREFIX.{idx,bin} (uint16) of TOKENS (200) tokens, one of them ID.
"""
import json
import os
import re
import struct
import subprocess
import sys


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("$ " + " ".join(cmd) + "\n" + p.stdout, end="")
    if p.returncode != 0:
        sys.exit(f"eval_check: exit status {p.returncode}")
    m = re.search(r"^eval: (\d+) tokens in (\d+) batches: mean CE ([0-9.]+), perplexity", p.stdout, re.M)
    if not m:
        sys.exit("eval_check: no 'eval: N tokens in B batches: mean CE X' line")
    return int(m.group(1)), float(m.group(3))


def close(a, b, rel=1e-4):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def agree(keel, run_dir, extra):
    evals = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "eval_loss" in r:
                evals[r["step"]] = r["eval_loss"]
    checked = 0
    for step, want in sorted(evals.items()):
        d = os.path.join(run_dir, f"step_{step:08d}")
        if not os.path.isdir(d):
            continue
        _, got = run([keel, "eval", d] + extra)
        ok = close(got, want)
        print(f"step {step}: keel train eval_loss {want:.6f}, keel eval mean CE {got:.6f}: "
              f"{'agree' if ok else 'DIFFER'} (relative {abs(got - want) / want:.2e})")
        if not ok:
            sys.exit("eval_check: keel eval disagrees with keel train's eval loss")
        checked += 1
    if checked < 2:
        sys.exit(f"eval_check: {checked} checkpoints with an eval loss in {run_dir}, wanted 2 or more")
    print(f"eval_check: {checked} checkpoints agree")


def logprobs(keel, ckpt, prefix, out):
    tokens, ce = run([keel, "eval", ckpt, "--data", prefix, "--device", "cpu", "--logprobs", out, "--top-k", "3"])
    lps = []
    with open(out) as f:
        for line in f:
            if line.startswith("#"):
                continue
            cols = line.rstrip("\n").split("\t")
            lp = float(cols[3])
            top1 = float(cols[4].split(" ")[0].split(":")[1])
            if lp > top1 + 1e-5:
                sys.exit(f"eval_check: row {line!r}: target log-probability above the top-1's")
            lps.append(lp)
    mean = -sum(lps) / len(lps)
    print(f"{len(lps)} rows, mean -logprob {mean:.6f}, printed CE {ce:.6f}")
    if len(lps) != tokens or not close(mean, ce):
        sys.exit("eval_check: the per-token log-probabilities do not give the printed CE")


def bad_vocab(prefix, token, n=200):
    ids = [i % 250 for i in range(n)]
    ids[n // 2] = token
    with open(prefix + ".bin", "wb") as f:
        f.write(struct.pack(f"<{len(ids)}H", *ids))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 1, 2) + struct.pack("<i", len(ids))
    idx += struct.pack("<q", 0) + struct.pack("<qq", 0, 1)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[:1] == ["agree"] and len(a) >= 3:
        agree(a[1], a[2], a[3:])
    elif a[:1] == ["logprobs"] and len(a) == 5:
        logprobs(*a[1:])
    elif a[:1] == ["bad-vocab"] and len(a) in (3, 4):
        bad_vocab(a[1], int(a[2]), int(a[3]) if len(a) == 4 else 200)
    else:
        sys.exit(__doc__)

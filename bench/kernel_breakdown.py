#!/usr/bin/env python3
"""Where a command's GPU time goes, kernel by kernel, through Nsight Compute.

    python3 bench/kernel_breakdown.py [--top N] [--match REGEX] -- build-gpu/keel train run.yaml

Runs the command under `ncu` measuring only gpu__time_duration per kernel launch (one replay
pass), then prints the kernels grouped by name: launches, total and mean time, share of the
total. Kernels run serialized under ncu, so the times are each kernel alone on the GPU (no
overlap between streams): a breakdown, not a step time.

ncu's defaults would lock the GPU clocks to base (`--clock-control base`); this script passes
`--clock-control none` so the clocks are left as the machine has them.
"""
import argparse
import collections
import csv
import io
import re
import shutil
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--top", type=int, default=40, help="kernels to print (by total time)")
    ap.add_argument("--match", default="", help="only kernels whose name matches this regex")
    ap.add_argument("--csv", help="also write the grouped table here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to profile")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        sys.exit("kernel_breakdown: no command given (put it after --)")
    prof = [a.ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
            "--print-units", "base", "--print-kernel-base", "function"]
    r = subprocess.run(prof + cmd, capture_output=True, text=True)
    text = r.stdout
    start = text.find('"ID"')
    if r.returncode != 0 or start < 0:
        sys.stderr.write(text[-3000:] + r.stderr[-3000:])
        sys.exit(f"kernel_breakdown: ncu exited {r.returncode} with no kernel table")
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    pattern = re.compile(a.match) if a.match else None
    groups = collections.defaultdict(lambda: [0, 0.0])
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        if pattern and not pattern.search(name):
            continue
        g = groups[name]
        g[0] += 1
        g[1] += float(row["Metric Value"].replace(",", "")) * 1e-3  # ns -> us
    total = sum(g[1] for g in groups.values())
    order = sorted(groups.items(), key=lambda kv: -kv[1][1])
    print(f"{'kernel':60s} {'launches':>8s} {'total us':>11s} {'mean us':>10s} {'share':>7s}")
    for name, (n, us) in order[:a.top]:
        print(f"{name[:60]:60s} {n:8d} {us:11.1f} {us / n:10.2f} {100 * us / total:6.1f}%")
    print(f"{'all ' + str(len(groups)) + ' kernels':60s} {sum(g[0] for g in groups.values()):8d} {total:11.1f}")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kernel", "launches", "total_us", "mean_us"])
            for name, (n, us) in order:
                w.writerow([name, n, f"{us:.3f}", f"{us / n:.3f}"])


if __name__ == "__main__":
    main()

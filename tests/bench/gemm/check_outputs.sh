#!/usr/bin/env bash
# Runs `keel bench gemm --backend cpu` with --json/--csv/--plot and checks what it wrote: the
# JSON carries the schema and the fields other tools read (m, n, k, dtype, tflops), and its
# numbers agree with each other; the CSV has a row per GEMM; the PNG is a PNG.
set -euo pipefail
keel=$1
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
OPENBLAS_NUM_THREADS=2 "$keel" bench gemm --backend cpu --m 32:128:32 --n 64 --k 48,96 -w 1 --iters 3 --check-samples 8 --rotate 4M \
  --json "$dir/g.json" --csv "$dir/g.csv" --plot "$dir/g.png" >"$dir/stdout"
python3 - "$dir" <<'PY'
import json, sys, os
d = sys.argv[1]
doc = json.load(open(os.path.join(d, "g.json")))
assert doc["schema"] == "keel.bench.gemm/1", doc["schema"]
for key in ("keel_version", "command", "args", "env", "devices", "libraries", "conventions", "results"):
    assert key in doc, key
assert doc["command"] == "bench gemm" and doc["backend"] == "openblas"
assert doc["env"].get("OPENBLAS_NUM_THREADS") == "2"
assert doc["devices"][0]["name"] and doc["devices"][0]["sm_count"] >= 1
rows = doc["results"]
assert len(rows) == 4 * 2, len(rows)   # m in 32..128 step 32, k in {48, 96}
for r in rows:
    assert r["dtype"] == "fp32" and r["layout"] == "nn"
    assert r["flops"] == 2 * r["m"] * r["n"] * r["k"] * r["batch"]
    assert abs(r["tflops"] - r["flops"] / (r["median_us"] * 1e6)) < 1e-6 * r["tflops"]
    assert r["min_us"] <= r["median_us"]
    assert r["checked"] and r["wrong"] == 0 and r["nonfinite"] == 0 and r["check_samples"] == 8
    assert r["algo"]["source"] == "openblas"
assert doc["check_failures"] == 0
csv = open(os.path.join(d, "g.csv")).read().strip().splitlines()
assert csv[0].startswith("name,pass,m,n,k,batch"), csv[0]
assert len(csv) == 1 + 8, len(csv)
assert open(os.path.join(d, "g.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
print("outputs ok")
PY

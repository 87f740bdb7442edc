#!/usr/bin/env bash
# Runs `keel bench mem --backend cpu` with --json/--csv/--plot and checks what it wrote: the
# JSON carries the schema and the fields other tools read (kernel, bytes, gbps), and its
# numbers agree with each other; the CSV has a row per result; the PNG is a PNG.
set -euo pipefail
keel=$1
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
OMP_NUM_THREADS=2 "$keel" bench mem --backend cpu --threads 2 --op copy,triad,dot -b 4K -e 64K -f 4 -w 1 -n 3 \
  --json "$dir/m.json" --csv "$dir/m.csv" --plot "$dir/m.png" >"$dir/stdout"
python3 - "$dir" <<'PY'
import json, sys, os
d = sys.argv[1]
doc = json.load(open(os.path.join(d, "m.json")))
assert doc["schema"] == "keel.bench.mem/1", doc["schema"]
for key in ("keel_version", "command", "args", "env", "devices", "libraries", "conventions", "results"):
    assert key in doc, key
assert doc["command"] == "bench mem" and doc["backend"] == "cpu"
assert doc["env"].get("OMP_NUM_THREADS") == "2"
assert doc["devices"][0]["name"] and doc["devices"][0]["sm_count"] == 2
assert "BabelStream" in doc["conventions"]["bytes"]
rows = doc["results"]
assert len(rows) == 3 * 3, len(rows)   # 3 kernels x (4K, 16K, 64K)
arrays = {"copy": 2, "triad": 3, "dot": 2}
for r in rows:
    assert r["wrong"] == 0 and r["checked"]
    assert r["bytes"] == arrays[r["kernel"]] * r["array_bytes"], r
    assert abs(r["gbps"] - r["bytes"] / (r["best_us"] * 1e3)) < 1e-6 * r["gbps"]
    assert r["gbps"] >= r["gbps_median"] - 1e-9
    assert r["pct_peak"] is None and 0 < r["pct_best"] <= 100 + 1e-9
for k in arrays:
    assert abs(max(r["pct_best"] for r in rows if r["kernel"] == k) - 100) < 1e-9
csv = open(os.path.join(d, "m.csv")).read().strip().splitlines()
assert csv[0].startswith("kernel,dtype,array_bytes,elements,bytes"), csv[0]
assert len(csv) == 1 + 9, len(csv)
assert open(os.path.join(d, "m.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
print("outputs ok")
PY

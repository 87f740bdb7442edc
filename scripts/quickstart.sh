#!/usr/bin/env bash
# One command from a fresh machine to keel's main job: install dependencies, build, and run
# the embedded defaults: the collective benchmark on whatever is here (every local GPU
# through NCCL when there are 2 or more, else 4 CPU ranks under MPI: a collective needs two
# ranks), then a tiny MoE trained on
# the shipped corpus. Results land in ./out (tables, JSON, CSV, PNG plots, training log).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p out
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
common=(--op all --json out/bench_comm.json --csv out/bench_comm.csv --plot out/bench_comm.png)
if [ "$gpus" -ge 2 ]; then
  echo "keel quickstart: $gpus GPU(s) found: one process drives them all through NCCL"
  build/keel bench comm --backend nccl --dtype bf16 --min 8 --max 1G --factor 4 "${common[@]}"
else
  echo "keel quickstart: $gpus GPU(s) found, a collective needs 2: 4 CPU ranks under MPI (--backend mpi)"
  mpi_flags=(--oversubscribe)
  [ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)
  mpiexec "${mpi_flags[@]}" -n 4 build/keel bench comm --backend mpi --dtype fp32 --min 64 --max 16M --factor 4 "${common[@]}"
fi
echo "keel quickstart: results in out/ (bench_comm.json, bench_comm.csv, bench_comm_*.png)"

# Then train the tiny MoE on the shipped corpus and watch the loss fall: on the GPU when there
# is one (seconds), else on the CPU reference path (about a minute). Each quickstart starts a
# fresh demo run (keel train refuses to write over an earlier run's checkpoints), and re-tokenizes
# the corpus over the last quickstart's (--force: keel data tokenize replaces a dataset only so).
build/keel data tokenize data/corpus/stories.jsonl --out out/corpus/stories --append-eos --holdout 0.05 --force
rm -rf out/train-tiny
build/keel train configs/train/tiny.yaml
echo "keel quickstart: training log in out/train-tiny (metrics.jsonl, checkpoints)"

#!/usr/bin/env bash
# End-to-end `keel data`: tokenize the corpus into two datasets, blend them in phases, check that
# a resumed run and a 2-rank run give exactly the batches of one uninterrupted 1-rank run, and that
# truncated files give one clear error.
# Usage: check_pipeline.sh KEEL CORPUS_DIR
set -euo pipefail
keel=$1; corpus=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
fail() { echo "check_pipeline: $*"; exit 1; }

"$keel" data tokenize "$corpus/stories.jsonl" --out "$dir/stories" --append-eos -q
"$keel" data tokenize "$corpus/arithmetic.jsonl" --out "$dir/arith" --append-eos -q
cat > "$dir/blend.yaml" <<YAML
seq_length: 64
seed: 7
datasets:
  stories: stories
  arith: arith
phases:
  - name: stories-only
    tokens: 1024          # 16 samples
    weights: {stories: 1}
  - name: mixed
    weights: {stories: 0.5, arith: 0.5}
YAML

full=$("$keel" data batches "$dir/blend.yaml" --global-batch 4 --steps 8)
echo "$full"
[ "$(echo "$full" | grep -c 'phase stories-only')" = 4 ] || fail "expected 4 batches in phase 1"
echo "$full" | sed -n 5p | grep -q 'phase mixed' || fail "batch 5 should open phase 2"
echo "$full" | sed -n 5p | grep -Eq 'stories:16 arith:0 stories:17 arith:1' || fail "phase 2 should alternate"

# Resume: 3 batches, save, 5 more.
a=$("$keel" data batches "$dir/blend.yaml" --global-batch 4 --steps 3 --save-state "$dir/state.json")
b=$("$keel" data batches "$dir/blend.yaml" --global-batch 4 --steps 5 --resume "$dir/state.json")
[ "$(printf '%s\n%s\n' "$(echo "$a" | grep '^batch')" "$b")" = "$full" ] || fail "resumed run differs"
grep -q '"consumed_samples": 12' "$dir/state.json" || fail "state should record 12 samples"

# A state from another configuration is refused, naming what differs.
sed 's/^seed: 7$/seed: 8/' "$dir/blend.yaml" > "$dir/other.yaml"
out=$("$keel" data batches "$dir/other.yaml" --resume "$dir/state.json" 2>&1) && fail "foreign state accepted"
echo "$out" | grep -Eq "^keel: error: data state: saved for seed 7, .* this run has seed 8" || fail "bad message: $out"

# Two ranks: each sees every second sample of the same global batches.
r0=$("$keel" data batches "$dir/blend.yaml" --global-batch 4 --steps 8 --rank 0 --world 2)
r1=$("$keel" data batches "$dir/blend.yaml" --global-batch 4 --steps 8 --rank 1 --world 2)
refs() { sed 's/.*hash [0-9a-f]*  //'; }
merged=$(paste -d' ' <(echo "$r0" | refs) <(echo "$r1" | refs) | awk '{print $1, $3, $2, $4}')
[ "$merged" = "$(echo "$full" | refs)" ] || fail "2-rank order differs from 1 rank"

# Truncated or damaged files.
cp "$dir/stories.idx" "$dir/cut.idx"; head -c 1000 "$dir/stories.bin" > "$dir/cut.bin"
out=$("$keel" data inspect "$dir/cut" 2>&1) && fail "truncated .bin accepted"
echo "$out" | grep -Eq "^keel: error: .*cut\.bin: truncated \(1000 bytes; .*cut\.idx needs [0-9]+ for its [0-9]+ tokens\)$" || fail "bad message: $out"
head -c 100 "$dir/stories.idx" > "$dir/cut.idx"; cp "$dir/stories.bin" "$dir/cut.bin"
out=$("$keel" data inspect "$dir/cut" 2>&1) && fail "truncated .idx accepted"
echo "$out" | grep -Eq "^keel: error: .*cut\.idx: truncated index \(100 bytes; " || fail "bad message: $out"
printf 'not an index at all, just text' > "$dir/cut.idx"
out=$("$keel" data inspect "$dir/cut" 2>&1) && fail "bad magic accepted"
echo "$out" | grep -Eq "^keel: error: .*cut\.idx: not a Megatron indexed dataset \(bad magic" || fail "bad message: $out"
echo "check_pipeline: ok"

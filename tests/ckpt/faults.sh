#!/usr/bin/env bash
# keel ckpt under faults, as a user meets them: a rank killed mid-save (the previous
# checkpoint stays `latest` and loads; the torn directory is reported incomplete and ignored),
# then a corrupted and a truncated data file (verify and load name them; nothing loads wrong).
# Usage: faults.sh KEEL MPIEXEC
set -u
keel=$1; mpiexec="$2 --oversubscribe --bind-to none"
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
root=$dir/root
fail() { echo "faults.sh: $*"; exit 1; }
run() { echo "+ $*"; out=$("$@" 2>&1); rc=$?; printf '%s\n' "$out"; }

run $mpiexec -n 4 "$keel" ckpt demo-save "$root" --layout dp=2,tp=2,zero=1 --step 10
[ $rc -eq 0 ] || fail "the first save failed"

# Rank 2 dies after writing part of its data for step 20.
run $mpiexec -n 4 "$keel" ckpt demo-save "$root" --layout dp=2,tp=2,zero=1 --step 20 --timeout 30 \
  --inject-die-rank 2 --inject-die-after 65536
[ $rc -ne 0 ] || fail "a save with a dead rank exited 0"
printf '%s\n' "$out" | grep -q "fault injection: rank exits" || fail "the fault was not injected"
[ -d "$root/step_00000020" ] || fail "expected the torn step_00000020 directory to remain for this test"
[ "$(cat "$root/latest")" = "step_00000010" ] || fail "latest moved: $(cat "$root/latest")"

run "$keel" ckpt verify "$root"
[ $rc -eq 0 ] || fail "verify failed on a root whose latest is intact"
printf '%s\n' "$out" | grep -q "step_00000020  INCOMPLETE" || fail "verify did not report the torn save"
printf '%s\n' "$out" | grep -q "step_00000010  committed  <- latest" || fail "verify did not show latest"

run $mpiexec -n 3 "$keel" ckpt demo-load "$root" --layout ep=3
[ $rc -eq 0 ] || fail "the previous checkpoint does not load"
printf '%s\n' "$out" | grep -q "loaded step 10" || fail "did not load step 10"

run "$keel" ckpt demo-load "$root/step_00000020" --layout dp=1
[ $rc -ne 0 ] || fail "the torn checkpoint loaded"
printf '%s\n' "$out" | grep -q "incomplete checkpoint (no metadata.json)" || fail "no clear error for the torn save"

# Saving step 20 again replaces the torn directory.
run $mpiexec -n 4 "$keel" ckpt demo-save "$root" --layout dp=2,tp=2,zero=1 --step 20
[ $rc -eq 0 ] || fail "re-saving step 20 failed"
[ "$(cat "$root/latest")" = "step_00000020" ] || fail "latest did not move to step 20"

# Corrupt one byte in the middle of the largest data file.
file=$(ls -S "$root"/step_00000020/data_*.bin | head -1)
size=$(stat -c %s "$file"); off=$((size / 2))
b=$(od -An -tu1 -j $off -N1 "$file" | tr -d ' '); nb=$(( (b + 1) % 256 ))
printf "\\$(printf %03o $nb)" | dd of="$file" bs=1 seek=$off conv=notrunc status=none
run "$keel" ckpt verify "$root"
[ $rc -eq 2 ] || fail "verify of a corrupted checkpoint exited $rc, not 2"
printf '%s\n' "$out" | grep -q "checksum mismatch" || fail "verify did not name the corruption"
run $mpiexec -n 4 "$keel" ckpt demo-load "$root" --layout dp=2,tp=2,zero=1
[ $rc -ne 0 ] || fail "a corrupted checkpoint loaded"
printf '%s\n' "$out" | grep -q "keel: error: .*tensor '.*': checksum mismatch" || fail "no checksum error naming the tensor"

# Truncate it.
truncate -s $off "$file"
run "$keel" ckpt demo-load "$root" --layout dp=1
[ $rc -ne 0 ] || fail "a truncated checkpoint loaded"
printf '%s\n' "$out" | grep -q "is truncated or damaged" || fail "no truncation error"
# A metadata file from another format version is rejected by name, never half-read.
sed -i 's/"version": 1/"version": 2/' "$root/step_00000010/metadata.json"
run "$keel" ckpt demo-load "$root/step_00000010" --layout dp=1
[ $rc -ne 0 ] || fail "a version-2 metadata file loaded"
printf '%s\n' "$out" | grep -q "metadata.json: metadata format version 2, but this keel reads version 1 only" ||
  fail "no clear version error"
echo "faults.sh: ok"

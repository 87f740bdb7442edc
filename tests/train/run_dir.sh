#!/usr/bin/env bash
# keel train's run directory with real processes (issue 34; docs/train.md "One run per directory",
# "Stopping on a signal"):
#   lock          two runs started at once into one directory (another lr): one is refused naming
#                 the other; then a --resume, another output_dir with the same checkpoint.dir and
#                 a 2-rank run are refused too; the holder killed, its stale lock is taken over by
#                 a resume, and every checkpoint it committed verifies
#   signal        SIGINT stops a run at a step boundary with that step saved (exit 130); it resumes
#   signal-mpi    SIGTERM to rank 1 alone of 2 ranks: both stop at the same step, saved (exit 143)
#   second-signal a second SIGTERM exits at once (the run is stuck in a step: no boundary comes)
#   restart       a run killed before its first checkpoint: a fresh run is refused, --resume of
#                 the directory starts again from step 0
# Usage: run_dir.sh CASE KEEL MPIEXEC CONFIG STORIES_PREFIX
set -u
what=$1; keel=$2; mpiexec="$3 --oversubscribe --bind-to none"; cfg=$4; stories=$5
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "run_dir.sh $what: $*"; exit 1; }
short=(--set "data.datasets.stories=$stories" --set "eval.prefix=${stories}_heldout" --set data.seq_length=64
       --set batch.micro_batch=4 --set log_interval=1 --set schedule.warmup_steps=4 --set device=cpu --timeout 60)
out=$dir/run

# wait_for FILE REGEX: until a line of FILE matches (at most 60 s).
wait_for() {
  for _ in $(seq 600); do grep -Eq -- "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  cat "$1"; fail "timed out waiting for /$2/ in $1"
}
# finish PID: its exit status, waiting at most 60 s (then it is killed and the test fails).
finish() {
  for _ in $(seq 600); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$1" 2>/dev/null && { kill -KILL "$1"; fail "pid $1 did not exit within 60 s"; }
  wait "$1"
}
run() { echo "+ $*"; res=$(timeout 60 "$@" 2>&1); rc=$?; printf '%s\n' "$res"; }
latest_step() { sed 's/^step_0*\([0-9]\)/\1/' "$out/latest"; }

case "$what" in
lock)
  # two runs started at once into one new directory (the second with another lr): exactly one
  # is refused, at start-up, naming the other; the other trains on
  "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set checkpoint.interval=1 --set "output_dir=$out" \
    > "$dir/a.log" 2>&1 &
  a=$!; pids+=($a)
  "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set checkpoint.interval=1 --set optimizer.lr=1e-3 \
    --set "output_dir=$out" > "$dir/b.log" 2>&1 &
  b=$!; pids+=($b)
  loser=""
  for _ in $(seq 300); do
    kill -0 $a 2>/dev/null || { loser=$a; winner=$b; break; }
    kill -0 $b 2>/dev/null || { loser=$b; winner=$a; break; }
    sleep 0.1
  done
  [ -n "$loser" ] || fail "two runs into one directory both ran for 30 s"
  wait $loser; rc=$?
  log=$dir/a.log; [ $loser = $b ] && log=$dir/b.log
  cat "$log"
  [ $rc -eq 1 ] || fail "the refused run exited $rc, not 1"
  grep -Eq "^keel: error: output_dir $out is in use by another run: pid $winner on host .* holds its lock $out/.keel-lock; wait for that run to end" "$log" ||
    fail "the refusal does not name the holder (pid $winner)"
  [ "$(wc -l < "$log")" -eq 1 ] || fail "the refused run printed more than its one error line"
  a=$winner
  wait_for "$([ $a = $b ] && echo "$dir/b.log" || echo "$dir/a.log")" "^step +3/"
  run "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set "output_dir=$out" --resume "$out"
  [ $rc -eq 1 ] && printf '%s\n' "$res" | grep -q "is in use by another run: pid $a " || fail "a --resume of it at once was not refused"
  run "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set "output_dir=$dir/other" --set "checkpoint.dir=$out"
  [ $rc -eq 1 ] && printf '%s\n' "$res" | grep -q "^keel: error: checkpoint.dir $out is in use by another run: pid $a " ||
    fail "a run with its own output_dir but the same checkpoint.dir was not refused"
  # two ranks of one run: rank 0 holds the lock for the run; refused, all ranks, one line
  run $mpiexec -n 2 "$keel" train "$cfg" "${short[@]}" --set batch.grad_accum=2 --set steps=100000 --set "output_dir=$out"
  [ $rc -ne 0 ] || fail "a 2-rank run into the directory exited 0"
  [ "$(printf '%s\n' "$res" | grep -c "keel: error: .*is in use by another run: pid $a ")" -eq 1 ] ||
    fail "the 2-rank run did not give exactly one refusal line"
  kill -0 $a 2>/dev/null || fail "the first run died"
  # the holder dies without cleaning up: what it committed is intact, and its lock is stale
  kill -KILL $a; wait $a 2>/dev/null
  [ -s "$out/.keel-lock" ] || fail "the killed run's lock file is empty: nothing to recognise as stale"
  run "$keel" ckpt verify "$out" --all
  [ $rc -eq 0 ] || fail "a checkpoint the only writer committed does not verify"
  # the newest committed step (SIGKILL may land between a commit and its `latest`: the resume takes it)
  n=$(ls -d "$out"/step_*/metadata.json | tail -1 | sed 's|.*/step_0*\([0-9][0-9]*\)/metadata.json|\1|')
  run "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set checkpoint.interval=1 --set "output_dir=$out" \
    --resume "$out" --stop-after $((n + 1))
  [ $rc -eq 0 ] || fail "the resume after the holder died exited $rc"
  printf '%s\n' "$res" | grep -q "output_dir $out: the run that held its lock is gone (pid $a on host" ||
    fail "the stale lock was not recognised"
  printf '%s\n' "$res" | grep -Eq "resumed from $out/step_0*$n at step $n " || fail "did not resume from step $n"
  ;;
signal)
  "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set "output_dir=$out" > "$dir/a.log" 2>&1 &
  a=$!; pids+=($a)
  wait_for "$dir/a.log" "^step +3/"
  kill -INT $a
  finish $a; rc=$?
  cat "$dir/a.log"
  [ $rc -eq 130 ] || fail "a run stopped by SIGINT exited $rc, not 130"
  line=$(grep -E "^stopped on SIGINT after step [0-9]+ of 100000: checkpoint $out/step_[0-9]{8}; continue with --resume $out\$" "$dir/a.log") ||
    fail "no line saying where it stopped and saved"
  n=$(printf '%s\n' "$line" | sed 's/^stopped on SIGINT after step \([0-9]*\) .*/\1/')
  [ "$(latest_step)" = "$n" ] || fail "latest is not the step it stopped at ($n)"
  run "$keel" ckpt verify "$out"
  [ $rc -eq 0 ] && printf '%s\n' "$res" | grep -q "a complete train state" || fail "the stop's checkpoint does not verify"
  run "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set "output_dir=$out" --resume "$out" --stop-after $((n + 2))
  [ $rc -eq 0 ] && printf '%s\n' "$res" | grep -Eq "resumed from $out/step_0*$n at step $n " || fail "no resume from step $n"
  ;;
signal-mpi)
  $mpiexec -n 2 "$keel" train "$cfg" "${short[@]}" --set batch.grad_accum=2 --set steps=100000 --set "output_dir=$out" \
    > "$dir/a.log" 2>&1 &
  a=$!; pids+=($a)
  wait_for "$dir/a.log" "^step +3/"
  r1=""
  for c in $(ps --ppid $a -o pid=); do
    tr '\0' '\n' < /proc/$c/environ 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && r1=$c
  done
  [ -n "$r1" ] || fail "rank 1's process not found among mpiexec's children"
  kill -TERM $r1
  finish $a; rc=$?
  cat "$dir/a.log"
  [ $rc -ne 0 ] || fail "mpiexec exited 0"
  grep -q "keel: \[rank 1\] SIGTERM received" "$dir/a.log" || fail "rank 1 did not say it got the signal"
  grep -q "keel: \[rank 0\] SIGTERM received" "$dir/a.log" && fail "rank 0 got the signal too: not the case tested"
  # rank 0 speaks: it stopped at the step rank 1 asked for
  line=$(grep -E "^stopped on SIGTERM after step [0-9]+ of 100000: checkpoint $out/step_[0-9]{8}; continue with --resume $out\$" "$dir/a.log") ||
    fail "no line saying where the run stopped and saved"
  n=$(printf '%s\n' "$line" | sed 's/^stopped on SIGTERM after step \([0-9]*\) .*/\1/')
  [ "$(latest_step)" = "$n" ] || fail "latest is not the step it stopped at ($n)"
  run "$keel" ckpt verify "$out" --all
  [ $rc -eq 0 ] || fail "the stop's checkpoint does not verify"
  ;;
second-signal)
  # step 3 never ends (fault injection): no step boundary comes, so only the second signal ends it
  "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set "output_dir=$out" --inject-hang-rank 0 \
    --inject-hang-step 3 > "$dir/a.log" 2>&1 &
  a=$!; pids+=($a)
  wait_for "$dir/a.log" "fault injection: rank 0 hangs at step 3"
  kill -TERM $a
  sleep 0.5
  kill -0 $a 2>/dev/null || { cat "$dir/a.log"; fail "the first signal ended the run at once"; }
  kill -TERM $a
  finish $a; rc=$?
  cat "$dir/a.log"
  [ $rc -eq 143 ] || fail "exit $rc after the second SIGTERM, not 143"
  grep -q "^keel: second signal (SIGTERM): exiting at once, without saving" "$dir/a.log" || fail "no line for the second signal"
  ;;
restart)
  "$keel" train "$cfg" "${short[@]}" --set steps=100000 --set checkpoint.interval=1000 --set "output_dir=$out" \
    > "$dir/a.log" 2>&1 &
  a=$!; pids+=($a)
  wait_for "$dir/a.log" "^step +3/"
  kill -KILL $a; wait $a 2>/dev/null
  [ -s "$out/metrics.jsonl" ] && [ ! -e "$out/latest" ] || fail "not the state a run killed before its first checkpoint leaves"
  run "$keel" train "$cfg" "${short[@]}" --set steps=6 --set "output_dir=$out"
  [ $rc -eq 1 ] && printf '%s\n' "$res" | grep -q "already holds another run's metrics.jsonl: continue that run with --resume $out," ||
    fail "a fresh run into it was not refused pointing at --resume"
  lines=$(wc -l < "$out/metrics.jsonl")
  run "$keel" train "$cfg" "${short[@]}" --set steps=6 --set "output_dir=$out" --resume "$out"
  [ $rc -eq 0 ] || fail "--resume of it exited $rc"
  printf '%s\n' "$res" | grep -q "^--resume $out: no checkpoint was committed there yet (the run stopped before its first save): starting at step 0" ||
    fail "the restart is not said"
  printf '%s\n' "$res" | grep -q "^done: steps 0 -> 6 " || fail "did not train from step 0"
  [ "$(wc -l < "$out/metrics.jsonl")" -gt "$lines" ] || fail "the metrics were not appended"
  [ "$(latest_step)" = 6 ] || fail "no checkpoint of step 6"
  ;;
*) fail "unknown case" ;;
esac
echo "run_dir.sh $what: ok"

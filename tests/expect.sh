#!/usr/bin/env bash
# Usage: expect.sh [--gpus COUNTS COUNTER] EXIT REGEX [NOT_REGEX] -- command...
# Runs the command and passes only if its exit status is EXIT ("0", "nonzero", or a number),
# ("any" where either is right, e.g. a GPU test that must fail cleanly without one) and
# its combined output matches REGEX (extended grep; "" to skip) and does not match NOT_REGEX.
# --gpus COUNTS COUNTER: the expectation holds where COUNTER (keel_gpu_count: the GPUs keel sees)
# prints a number COUNTS allows, a comma list of N and N+ ("0,2+": none, or two and more);
# elsewhere the command is not run and the script exits 77 (CTest's SKIP_RETURN_CODE: skipped).
set -u
if [ "$1" = "--gpus" ]; then
  counts=$2; counter=$3; shift 3
  have=$("$counter") || { echo "expect.sh: $counter failed"; exit 1; }
  ok=0
  IFS=',' read -ra wanted <<<"$counts"
  for w in "${wanted[@]}"; do
    case "$w" in
      *+) [ "$have" -ge "${w%+}" ] && ok=1 ;;
      *) [ "$have" -eq "$w" ] && ok=1 ;;
    esac
  done
  if [ "$ok" -ne 1 ]; then
    echo "expect.sh: skipped: this expectation holds with $counts GPUs, keel sees $have here"
    exit 77
  fi
fi
want_exit=$1; regex=$2; shift 2
not_regex=""
if [ "$1" != "--" ]; then not_regex=$1; shift; fi
shift  # the --
out=$("$@" 2>&1); rc=$?
printf '%s\n' "$out"
case "$want_exit" in
  any) ;;
  nonzero) [ "$rc" -ne 0 ] || { echo "expect.sh: wanted a non-zero exit, got 0"; exit 1; } ;;
  *) [ "$rc" -eq "$want_exit" ] || { echo "expect.sh: wanted exit $want_exit, got $rc"; exit 1; } ;;
esac
if [ -n "$regex" ] && ! printf '%s\n' "$out" | grep -Eq -- "$regex"; then
  echo "expect.sh: output does not match: $regex"; exit 1
fi
if [ -n "$not_regex" ] && printf '%s\n' "$out" | grep -Eq -- "$not_regex"; then
  echo "expect.sh: output matches what it must not: $not_regex"; exit 1
fi
exit 0

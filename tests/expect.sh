#!/usr/bin/env bash
# Usage: expect.sh EXIT REGEX [NOT_REGEX] -- command...
# Runs the command and passes only if its exit status is EXIT ("0", "nonzero", or a number),
# ("any" where either is right, e.g. a GPU test that must fail cleanly without one) and
# its combined output matches REGEX (extended grep; "" to skip) and does not match NOT_REGEX.
set -u
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

#!/usr/bin/env bash
# Writes a metrics log with keel's MetricsLog (through keel_tests) and reads its TensorBoard event
# file back with the real tensorboard Python package. Usage: check_tensorboard.sh KEEL_TESTS
set -euo pipefail
keel_tests=$1
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
KEEL_TB_TEST_DIR="$dir" "$keel_tests" --gtest_filter='MetricsLog.WritesEventFileFor*'
# A filter that matches nothing still exits 0: make sure the file is there.
if ! ls "$dir"/events.out.tfevents.* >/dev/null 2>&1; then
  echo "check_tensorboard: FAIL: keel_tests wrote no event file in $dir"
  exit 1
fi
python3 "$here/check_tensorboard.py" "$dir"

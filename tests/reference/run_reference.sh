#!/usr/bin/env bash
# Runs tests/reference/hf_zaya_check.py (keel against Hugging Face transformers' ZayaForCausalLM)
# under the reference interpreter: $KEEL_REFERENCE_PYTHON if set, else SOURCE_ROOT/.venv-ref/bin/python
# (scripts/setup.sh --reference makes it). Without one, or when it cannot import torch and
# transformers' ZayaForCausalLM, the test is skipped (exit 77, CTest's SKIP_RETURN_CODE).
#   run_reference.sh forward|train KEEL SOURCE_ROOT WORKDIR
set -euo pipefail
[ $# -eq 4 ] || { echo "usage: $0 forward|train KEEL SOURCE_ROOT WORKDIR" >&2; exit 2; }
root=$3
py=${KEEL_REFERENCE_PYTHON:-}
if [ -z "$py" ]; then
  if [ -x "$root/.venv-ref/bin/python" ]; then
    py=$root/.venv-ref/bin/python
  else
    echo "hf_zaya_check: SKIP: no reference Python (set KEEL_REFERENCE_PYTHON, or run scripts/setup.sh --reference" \
         "to make $root/.venv-ref with CPU torch and transformers)"
    exit 77
  fi
fi
if ! command -v "$py" >/dev/null 2>&1; then
  echo "hf_zaya_check: SKIP: KEEL_REFERENCE_PYTHON=$py is not an executable"
  exit 77
fi
exec "$py" "$root/tests/reference/hf_zaya_check.py" "$@"

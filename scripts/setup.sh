#!/usr/bin/env bash
# Installs what keel's build needs from Debian/Ubuntu packages (nothing is vendored), then
# configures and builds keel in ./build. Idempotent: packages already present are skipped.
#   scripts/setup.sh             install dependencies and build
#   scripts/setup.sh --deps-only install dependencies only
#   scripts/setup.sh --reference make .venv-ref (git-ignored): CPU torch and Hugging Face transformers
#                                from PyPI for the reference tests (tests/reference: keel against
#                                transformers' ZayaForCausalLM); only this, never part of the default
# The CUDA toolkit (nvcc, NCCL, cuBLASLt, cuDNN) is not a Debian package here: keel builds its
# GPU code when /usr/local/cuda (or nvcc on PATH) is present, and the CPU paths otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--reference" ]; then
  # About 1 GB with torch's CPU wheel. KEEL_REFERENCE_PYTHON can name another
  # interpreter that has torch and transformers instead (tests/reference/run_reference.sh).
  if ! python3 -c "import ensurepip, venv" 2>/dev/null; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-venv
  fi
  [ -x .venv-ref/bin/python ] || python3 -m venv .venv-ref
  .venv-ref/bin/python -m pip install --quiet --upgrade pip
  # PyTorch's CPU-only wheel index first (small); where that index is unreachable, PyPI's torch
  # (the CUDA build, several GB, which runs on the CPU as well).
  .venv-ref/bin/python -m pip install --quiet --retries 1 --timeout 30 torch --index-url https://download.pytorch.org/whl/cpu ||
    { echo "keel setup: download.pytorch.org unreachable: torch from PyPI instead"; .venv-ref/bin/python -m pip install --quiet torch; }
  .venv-ref/bin/python -m pip install --quiet "transformers>=5.24" safetensors numpy pyyaml
  .venv-ref/bin/python -c "import torch, transformers; from transformers import ZayaForCausalLM; print('keel setup: .venv-ref has torch', torch.__version__, 'and transformers', transformers.__version__)"
  exit 0
fi

packages=(
  build-essential cmake ninja-build pkg-config
  libopenmpi-dev openmpi-bin
  nlohmann-json3-dev libcli11-dev libfmt-dev libyaml-cpp-dev libpng-dev
  libopenblas-dev libgtest-dev libgmock-dev libbenchmark-dev libzstd-dev libsentencepiece-dev
  python3 python3-pip
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "keel setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# tensorboard (PyPI, no Debian package) for the test that reads keel's event files with it;
# safetensors (+ numpy) for the test that reads keel's ZAYA1 safetensors export with it.
python3 -c "import tensorboard, safetensors, numpy" 2>/dev/null ||
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet tensorboard safetensors numpy

[ "${1:-}" = "--deps-only" ] && exit 0
exec scripts/build.sh

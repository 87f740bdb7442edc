#!/usr/bin/env bash
# Installs what keel's build needs from Debian/Ubuntu packages (nothing is vendored), then
# configures and builds keel in ./build. Idempotent: packages already present are skipped.
#   scripts/setup.sh             install dependencies and build
#   scripts/setup.sh --deps-only install dependencies only
# The CUDA toolkit (nvcc, NCCL, cuBLASLt, cuDNN) is not a Debian package here: keel builds its
# GPU code when /usr/local/cuda (or nvcc on PATH) is present, and the CPU paths otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

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

#!/usr/bin/env bash
# On a GPU machine: build keel's test binary for sm_90 and run the GoogleTest cases matching a
# filter (default: every CUDA test). The quick loop for kernel work; scripts/gpu.sh is the
# full build + tests + benchmarks run.
#   scripts/gpu_test.sh ['*Cuda*:*cuda*']  [extra gtest flags]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
build=${KEEL_BUILD_DIR:-build-gpu}
filter=${1:-'*Cuda*:*cuda*'}
shift || true
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null || exit 1
fi
start=$(date +%s)
if ! cmake --build "$build" -j "$(nproc)" --target keel_tests >"$build.log" 2>&1; then
  grep -E "error|Error" "$build.log" | head -40
  echo "build: FAILED"
  exit 1
fi
echo "build: ok ($(( $(date +%s) - start )) s)"
timeout "${KEEL_TEST_TIMEOUT:-300}" "$build/tests/keel_tests" --gtest_filter="$filter" "$@"

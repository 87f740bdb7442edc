#!/usr/bin/env bash
# Configures and builds keel (library, CLI, tests) in ./build (or $KEEL_BUILD_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KEEL_BUILD_DIR:-build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release ${KEEL_CMAKE_ARGS:-}
fi
cmake --build "$build" -j "$(nproc)"

#!/usr/bin/env bash
# Builds keel and runs the whole test suite (unit tests, multi-rank tests under mpiexec,
# and command-line tests). GPU tests skip cleanly on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
build=${KEEL_BUILD_DIR:-build}
# Multi-rank tests oversubscribe the cores; as root OpenMPI needs explicit consent.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@"

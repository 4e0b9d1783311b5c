#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh), builds everything, and runs the whole test suite.
# This is the README's test command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
bash scripts/setup.sh "$build_dir"
# Formatting first: a file that differs from .clang-format fails the run in seconds.
bash scripts/check_format.sh
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
# Two compiles at a time: one LibTorch translation unit takes about 1 GiB and 30 s.
ninja -C "$build_dir" -j "${LOOM_BUILD_JOBS:-2}"
# One test at a time: most tests start 2-3 rank processes of their own on this 2-core machine.
meson test -C "$build_dir" --print-errorlogs --num-processes 1 --timeout-multiplier 3

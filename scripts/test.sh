#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh), builds everything, and runs the whole test suite.
# This is the README's test command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
bash scripts/setup.sh "$build_dir"
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
ninja -C "$build_dir"
# One test at a time: most tests start 2-3 rank processes of their own on this 2-core machine.
meson test -C "$build_dir" --print-errorlogs --num-processes 1 --timeout-multiplier 3

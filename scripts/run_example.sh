#!/usr/bin/env bash
# The README's main command: installs what is needed (scripts/setup.sh), builds the
# finetune_icons example, and runs it with its defaults (2 ranks over Gloo on this machine).
# Arguments after the script name go to the example, e.g. `scripts/run_example.sh --epochs 2`.
#
# Usage: scripts/run_example.sh [EXAMPLE_ARGS...]      (build folder: $LOOM_BUILD_DIR, default build/;
#        compiles at a time: $LOOM_BUILD_JOBS, default 2, as scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${LOOM_BUILD_DIR:-build}
# The example needs only Debian's LibTorch build; the pip torch of the test command is skipped.
LOOM_SETUP_TORCH2=${LOOM_SETUP_TORCH2:-0} bash scripts/setup.sh "$build_dir"
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
ninja -C "$build_dir" -j "${LOOM_BUILD_JOBS:-2}" examples/finetune_icons
exec "$build_dir/examples/finetune_icons" --out "$build_dir/finetune_icons_out" "$@"

#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh), then builds loom and runs its tests against two
# LibTorch versions: the whole suite against pip's torch 2.13 (CPU; build-torch2/), and the
# multi-rank suites against Debian's libtorch-dev (1.13 on Debian 12; build/). This is the README's
# test command and what CI runs (.ci/run).
#
# Usage: scripts/test.sh [BUILD_DIR [TORCH2_BUILD_DIR]]
#   LOOM_TEST_DEBIAN=full   runs the whole suite against Debian's LibTorch too (about 25 min more)
#   LOOM_TEST_DEBIAN=none   skips Debian's LibTorch
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
torch2_build_dir=${2:-build-torch2}
start=$(date +%s)
bash scripts/setup.sh "$build_dir" "$torch2_build_dir"
# Formatting first: a file that differs from .clang-format fails the run in seconds.
bash scripts/check_format.sh
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
# Objects of one checkout are reused by another on the same machine (paths below it are hashed as
# relative paths).
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
jobs=${LOOM_BUILD_JOBS:-2}  # two compiles at a time: one LibTorch translation unit takes ~1 GiB and 30 s
stamp() { echo "test.sh: $* ($(( $(date +%s) - start )) s)"; }

# Disk (measured on a clean clone): build-torch2/ 2.3 GB (one 0.9 GB precompiled header of LibTorch
# for all test executables, objects with debug information), the multi-rank build/ 1.5 GB, .venv/
# 0.9 GB, ccache a little; 4.7 GB in all at the peak. Say so before a compiler fails with "No space
# left on device".
need_mb=6000
for d in "$torch2_build_dir" "$build_dir"; do
  [ -d "$d" ] && need_mb=$(( need_mb - $(du -sm "$d" | cut -f1) ))
done
avail_mb=$(df -Pm . | awk 'NR == 2 { print $4 }')
stamp "disk: ${avail_mb} MB free; the builds need about $(( need_mb > 0 ? need_mb : 0 )) MB more"
if [ "$avail_mb" -lt "$need_mb" ]; then
  echo "test.sh: warning: ${avail_mb} MB free on $(df -P . | awk 'NR == 2 { print $6 }') is less than the builds need" >&2
fi

# 1. LibTorch 2.13 (pip, CPU): build everything, run every test. One test at a time: most tests
#    start 2-3 rank processes of their own on this 2-core machine.
if [ -f "$torch2_build_dir/build.ninja" ]; then
  stamp "building against pip's LibTorch 2.13 in $torch2_build_dir/"
  ninja -C "$torch2_build_dir" -j "$jobs"
  stamp "testing against pip's LibTorch 2.13"
  meson test -C "$torch2_build_dir" --no-rebuild --print-errorlogs --num-processes 1 --timeout-multiplier 3 ||
    { stamp "failed against LibTorch 2.13"; exit 1; }
else
  stamp "no $torch2_build_dir/ (LOOM_SETUP_TORCH2=0): LibTorch 2.13 skipped"
fi

# 2. Debian's LibTorch: the multi-rank suites (real processes over Gloo, two hosts, mpirun), or
#    everything with LOOM_TEST_DEBIAN=full.
case "${LOOM_TEST_DEBIAN:-multirank}" in
  none) ;;
  full)
    stamp "building against Debian's LibTorch in $build_dir/"
    ninja -C "$build_dir" -j "$jobs"
    stamp "testing against Debian's LibTorch (whole suite)"
    meson test -C "$build_dir" --no-rebuild --print-errorlogs --num-processes 1 --timeout-multiplier 3
    ;;
  multirank)
    suites=(comm comm_mpirun comm_gloo_symbols dist dist_two_hosts log sample_dist accumulate-dist reduce-dist
            train-dist schedule_rank)
    targets=(tests/comm/test_comm tests/comm/test_mpirun tests/dist/test_dist tests/dist/test_two_hosts
             tests/log/test_log tests/sample/test_sample tests/accumulate/test_accumulate tests/reduce/test_reduce
             tests/train/test_train tests/schedule/test_schedule examples/readme_loop)
    stamp "building the multi-rank tests against Debian's LibTorch in $build_dir/"
    ninja -C "$build_dir" -j "$jobs" "${targets[@]}"
    stamp "testing against Debian's LibTorch (multi-rank suites: ${suites[*]})"
    meson test -C "$build_dir" --no-rebuild --print-errorlogs --num-processes 1 --timeout-multiplier 3 "${suites[@]}"
    ;;
  *) echo "test.sh: LOOM_TEST_DEBIAN must be multirank, full or none" >&2; exit 2 ;;
esac
stamp "done"

#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh), then builds loom and runs its tests against two
# LibTorch versions: the whole suite against pip's torch 2.13 (CPU; build-torch2/), and the
# multi-rank suites against Debian's libtorch-dev (1.13 on Debian 12; build/). This is the README's
# test command and what CI runs (.ci/run). It ends with a table of its phases and their seconds
# (setup, each build, each test entry), also when a phase fails.
#
# Usage: scripts/test.sh [BUILD_DIR [TORCH2_BUILD_DIR]]
#   LOOM_TEST_DEBIAN=full   runs the whole suite against Debian's LibTorch too (about 10 min more, as
#                           the pip leg's build and tests take; not timed)
#   LOOM_TEST_DEBIAN=none   skips Debian's LibTorch
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
torch2_build_dir=${2:-build-torch2}
start=$(date +%s)
stamp() { echo "test.sh: $* ($(( $(date +%s) - start )) s)"; }

# The phase table: one row per phase, then each test entry of a test phase (from Meson's
# meson-logs/testlog.json), printed when the script exits, whatever its outcome.
table=()
pending=()  # the test rows of the running phase, placed under its row
phase() {  # phase NAME COMMAND...: runs COMMAND, adds a row; returns COMMAND's status
  local name=$1 t0 rc=0
  shift
  t0=$(date +%s)
  stamp "$name"
  pending=()
  "$@" || rc=$?
  table+=("$(printf '%-60s %6d s%s' "$name" $(( $(date +%s) - t0 )) "$([ $rc -eq 0 ] || echo "  FAILED ($rc)")")")
  table+=(${pending[@]+"${pending[@]}"})
  return $rc
}
test_rows() {  # test_rows BUILD_DIR: a row per test entry of the last `meson test` in BUILD_DIR
  local log=$1/meson-logs/testlog.json
  [ -f "$log" ] || return 0
  while IFS= read -r row; do pending+=("$row"); done < <(python3 - "$log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    t = json.loads(line)
    mark = "" if t["result"] in ("OK", "SKIP", "EXPECTEDFAIL") else f"  {t['result']}"
    print(f"    {t['name']:<56} {t['duration']:6.1f} s{mark}")
PY
  )
}
print_table() {
  local rc=$?
  echo
  echo "test.sh: phases (seconds)"
  printf '%s\n' "${table[@]}"
  printf '%-60s %6d s\n' "total" $(( $(date +%s) - start ))
  return $rc
}
trap print_table EXIT
meson_test() {  # meson_test BUILD_DIR [TEST...]: one test at a time (most start 2-3 rank processes)
  local dir=$1 rc=0
  shift
  rm -f "$dir/meson-logs/testlog.json"  # no rows of an earlier run if this one runs nothing
  meson test -C "$dir" --no-rebuild --print-errorlogs --num-processes 1 --timeout-multiplier 3 "$@" || rc=$?
  test_rows "$dir"
  return $rc
}

phase "setup (scripts/setup.sh)" bash scripts/setup.sh "$build_dir" "$torch2_build_dir"
# Formatting first: a file that differs from .clang-format fails the run in seconds.
phase "format check" bash scripts/check_format.sh
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
# Objects of one checkout are reused by another on the same machine (paths below it are hashed as
# relative paths), except the test executables' unity units, which Meson writes with absolute paths:
# those are reused by a later build in the same folder.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# The test files compile with a precompiled header (-include test_pch.hpp -fpch-preprocess), which
# ccache caches only with this sloppiness (its manual, "Precompiled headers"); without it every test
# unit is "uncacheable" and a second run compiles them all again.
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
jobs=${LOOM_BUILD_JOBS:-2}  # two compiles at a time: one LibTorch translation unit takes 1-2.5 GiB

# Disk (measured on a clean clone): build-torch2/ 0.9 GB (0.7 GB of it the precompiled header of
# LibTorch for all test executables), the multi-rank build/ 0.7 GB, .venv/ 0.9 GB, ccache 0.25 GB;
# 2.7 GB in all. Say so before a compiler fails with "No space left on device".
need_mb=3500
for d in "$torch2_build_dir" "$build_dir"; do
  [ -d "$d" ] && need_mb=$(( need_mb - $(du -sm "$d" | cut -f1) ))
done
avail_mb=$(df -Pm . | awk 'NR == 2 { print $4 }')
stamp "disk: ${avail_mb} MB free; the builds need about $(( need_mb > 0 ? need_mb : 0 )) MB more"
if [ "$avail_mb" -lt "$need_mb" ]; then
  echo "test.sh: warning: ${avail_mb} MB free on $(df -P . | awk 'NR == 2 { print $6 }') is less than the builds need" >&2
fi

# 1. LibTorch 2.13 (pip, CPU): build everything, run every test.
if [ -f "$torch2_build_dir/build.ninja" ]; then
  phase "build: pip's LibTorch 2.13 ($torch2_build_dir/, everything)" ninja -C "$torch2_build_dir" -j "$jobs"
  phase "tests: pip's LibTorch 2.13 (every test)" meson_test "$torch2_build_dir"
else
  stamp "no $torch2_build_dir/ (LOOM_SETUP_TORCH2=0): LibTorch 2.13 skipped"
fi

# 2. Debian's LibTorch: the multi-rank suites (real processes over Gloo, two hosts, mpirun), or
#    everything with LOOM_TEST_DEBIAN=full. The multi-rank cases of each component are executables
#    of their own (tests/*/meson.build), so this leg compiles only them, and optim (ranks as threads:
#    the sharded optimizer state under LibTorch 1.13's string state keys).
case "${LOOM_TEST_DEBIAN:-multirank}" in
  none) ;;
  full)
    phase "build: Debian's LibTorch ($build_dir/, everything)" ninja -C "$build_dir" -j "$jobs"
    phase "tests: Debian's LibTorch (every test)" meson_test "$build_dir"
    ;;
  multirank)
    suites=(launch trace-dist comm comm_mpirun comm_gloo_symbols dist_two_hosts log sample_dist accumulate-dist
            reduce-dist train-dist recovery-dist schedule_rank optim)
    targets=(tests/launch/test_launch tests/trace/test_trace tests/comm/test_comm tests/comm/test_mpirun
             tests/dist/test_two_hosts
             tests/log/test_log tests/sample/test_sample_dist tests/accumulate/test_accumulate_dist
             tests/reduce/test_reduce_dist tests/train/test_train_dist tests/schedule/test_schedule_rank
             tests/optim/test_optim examples/readme_loop)
    phase "build: Debian's LibTorch ($build_dir/, the multi-rank tests)" ninja -C "$build_dir" -j "$jobs" "${targets[@]}"
    phase "tests: Debian's LibTorch (multi-rank: ${#suites[@]} entries)" meson_test "$build_dir" "${suites[@]}"
    ;;
  *) echo "test.sh: LOOM_TEST_DEBIAN must be multirank, full or none" >&2; exit 2 ;;
esac
stamp "done"

#!/usr/bin/env bash
# ThreadSanitizer run over loom's threaded parts: the generator loaders (worker threads, bounded
# queues, prefetch; suite `schedule`) and the reducer's autograd hooks with the accumulator
# (suites `reduce`, `accumulate`). Single-process suites only: TSan does not support a process
# that forks after starting threads, which is how loom::spawn starts ranks.
#
# Usage: bash scripts/tsan.sh [BUILD_DIR]        (default: build-tsan, beside build/)
# 1. Configures BUILD_DIR once with -Db_sanitize=thread -Db_lundef=false, no benchmarks or examples.
# 2. Builds the three test executables (ninja -j${LOOM_SANITIZE_JOBS:-2}, under the build lock).
# 3. Runs the suites one at a time with OMP_NUM_THREADS=1 (LibTorch's OpenMP pool is not
#    instrumented: its hand-offs would read as races) and
#      TSAN_OPTIONS  halt_on_error=1   the first report fails its test
#                    second_deadlock_stack=1
#                    suppressions=tests/support/tsan.supp   races inside LibTorch itself, named there
#    and a timeout multiplier of ${LOOM_SANITIZE_TIMEOUT_MULTIPLIER:-6} (TSan runs 5-15x slower).
# Exit code: 0 when every suite passed; otherwise meson test's.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)
build_dir=${1:-build-tsan}
jobs=${LOOM_SANITIZE_JOBS:-2}
lock=${LOOM_BUILD_LOCK:-/tmp/loom-build.lock}
targets=(tests/schedule/test_schedule tests/reduce/test_reduce tests/accumulate/test_accumulate)
suites=(schedule reduce accumulate)

start=$(date +%s)
phase() { echo "[tsan +$(($(date +%s) - start))s] $*"; }
if [ ! -f "$build_dir/build.ninja" ]; then
  phase "configuring $build_dir"
  flock "$lock" meson setup "$build_dir" "$src" --wrap-mode=nodownload \
    -Db_sanitize=thread -Db_lundef=false -Dbenchmarks=false -Dexamples=false
fi
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
for t in "${targets[@]}"; do
  t_start=$(date +%s)
  flock "$lock" ninja -C "$build_dir" -j"$jobs" "$t"
  phase "  $t: $(($(date +%s) - t_start)) s (lock wait included)"
done
export OMP_NUM_THREADS=1
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$src/tests/support/tsan.supp}
phase "running ${suites[*]} (TSAN_OPTIONS=$TSAN_OPTIONS)"
rc=0
meson test -C "$build_dir" --no-rebuild --print-errorlogs --num-processes 1 \
  --timeout-multiplier "${LOOM_SANITIZE_TIMEOUT_MULTIPLIER:-6}" "${suites[@]}" || rc=$?
phase "exit code $rc"
exit "$rc"

#!/usr/bin/env bash
# Sanitizer runs of loom's test suites: AddressSanitizer + UndefinedBehaviorSanitizer over the unit
# and multi-rank suites, or (--thread) ThreadSanitizer over the threaded parts.
#
# Usage: bash scripts/sanitize.sh [--thread] [BUILD_DIR]
#   (default BUILD_DIR: build-asan, or build-tsan with --thread; beside build/)
# 1. Configures BUILD_DIR once (under the build lock), as a second build folder next to the normal one:
#      -Db_sanitize=address,undefined (or thread) -Db_lundef=false   (libraries stay unsanitized, so
#                                                        undefined symbols are resolved at run time)
#      -Dbenchmarks=false -Dexamples=false               (only what the tests need)
# 2. Builds the test executables only (no benchmarks, no examples), under the machine's build lock
#    (flock /tmp/loom-build.lock, the lock `lbuild` takes; taken once per executable, so other
#    builds can run in between), with ninja -j${LOOM_SANITIZE_JOBS:-2}.
# 3. Runs the suites one at a time with meson test --no-rebuild and a timeout multiplier of
#    ${LOOM_SANITIZE_TIMEOUT_MULTIPLIER:-4} (ASan: 2-3x slower; TSan: 5-15x, so 8 by default):
#    ASan + UBSan: every unit and multi-rank suite, with
#      ASAN_OPTIONS  detect_leaks=0        LibTorch, Gloo and doctest keep process-lifetime
#                                          allocations that LeakSanitizer reports at exit;
#                    abort_on_error=1       a finding ends the process (SIGABRT), so its test fails
#      UBSAN_OPTIONS halt_on_error=1       by default UBSan prints and continues with exit code 0;
#                    print_stacktrace=1     this makes every finding fail its test, with a stack
#      Ranks started by loom::spawn inherit both variables, so findings inside ranks fail too.
#    TSan (--thread): the generator loaders (worker threads, bounded queues, prefetch: suite
#      `schedule`) and the reducer's autograd hooks under the accumulator (`reduce`, `accumulate`);
#      single-process suites only (TSan does not support a process that forks after starting
#      threads, which is how loom::spawn starts ranks), with OMP_NUM_THREADS=1 (LibTorch's OpenMP
#      pool is not instrumented: its hand-offs would read as races) and
#      TSAN_OPTIONS  halt_on_error=1:second_deadlock_stack=1:suppressions=tests/support/tsan.supp
#
# Exit code: 0 when every suite passed; otherwise meson test's (failing suites are listed, their
# output is in BUILD_DIR/meson-logs/testlog.txt). Prints the time each phase took.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)
mode=address
if [ "${1:-}" = --thread ]; then
  mode=thread
  shift
fi
jobs=${LOOM_SANITIZE_JOBS:-2}
lock=${LOOM_BUILD_LOCK:-/tmp/loom-build.lock}

# The test executables and the meson test entries that run them.
if [ "$mode" = thread ]; then
  build_dir=${1:-build-tsan}
  sanitizers=thread
  targets=(tests/schedule/test_schedule tests/reduce/test_reduce tests/accumulate/test_accumulate)
  suites=(schedule reduce accumulate)
  multiplier=${LOOM_SANITIZE_TIMEOUT_MULTIPLIER:-8}
else
  build_dir=${1:-build-asan}
  sanitizers=address,undefined
  targets=(tests/comm/test_comm tests/launch/test_launch tests/trace/test_trace tests/log/test_log tests/collate/test_collate
           tests/sample/test_sample tests/sample/test_sample_dist tests/reduce/test_reduce
           tests/reduce/test_reduce_dist tests/accumulate/test_accumulate tests/accumulate/test_accumulate_dist
           tests/train/test_train tests/train/test_train_dist tests/schedule/test_schedule
           tests/schedule/test_schedule_rank tests/optim/test_optim)
  suites=(optim comm launch trace trace-dist log collate sample sample_dist reduce reduce-dist accumulate accumulate-dist train train-dist
          recovery-dist schedule schedule_rank)
  multiplier=${LOOM_SANITIZE_TIMEOUT_MULTIPLIER:-4}
fi

start=$(date +%s)
phase() { echo "[sanitize +$(($(date +%s) - start))s] $*"; }

if [ ! -f "$build_dir/build.ninja" ]; then
  phase "configuring $build_dir"
  flock "$lock" meson setup "$build_dir" "$src" --wrap-mode=nodownload \
    -Db_sanitize="$sanitizers" -Db_lundef=false -Dbenchmarks=false -Dexamples=false
fi

phase "building ${#targets[@]} test executables (ninja -j$jobs, under $lock, one executable per lock hold)"
build_start=$(date +%s)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
# Only the executables this configuration defines (e.g. no Gloo: no test_*_dist).
defined=$(ninja -C "$build_dir" -t targets all | cut -d: -f1)
for t in "${targets[@]}"; do  # the lock is released between executables so other builds interleave
  if ! grep -qx -- "$t" <<<"$defined"; then phase "  $t not defined in this build, skipped"; continue; fi
  t_start=$(date +%s)
  flock "$lock" ninja -C "$build_dir" -j"$jobs" "$t"
  phase "  $t: $(($(date +%s) - t_start)) s (lock wait included)"
done
phase "build took $(($(date +%s) - build_start)) s"

# Only the suites whose test entry exists in this configuration (e.g. no Gloo: no *_dist).
# (meson test --list prints "loom / NAME" up to meson 1.x's later releases, "loom:NAME" since.)
available=$(meson test -C "$build_dir" --list --no-rebuild 2>/dev/null | sed -n -e 's#^loom / ##p' -e 's#^loom:##p')
run=()
for s in "${suites[@]}"; do
  if grep -qx -- "$s" <<<"$available"; then run+=("$s"); else phase "suite $s not defined in this build, skipped"; fi
done

if [ ${#run[@]} -eq 0 ]; then  # meson test without names would run every test, built or not
  phase "none of the suites ${suites[*]} is defined in $build_dir"
  exit 2
fi
if [ "$mode" = thread ]; then
  export OMP_NUM_THREADS=1
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$src/tests/support/tsan.supp}
  shown="OMP_NUM_THREADS=1 TSAN_OPTIONS=$TSAN_OPTIONS"
else
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
  shown="ASAN_OPTIONS=$ASAN_OPTIONS UBSAN_OPTIONS=$UBSAN_OPTIONS"
fi
phase "running ${run[*]} ($shown)"
test_start=$(date +%s)
rc=0
meson test -C "$build_dir" --no-rebuild --print-errorlogs --num-processes 1 \
  --timeout-multiplier "$multiplier" "${run[@]}" || rc=$?
phase "tests took $(($(date +%s) - test_start)) s; exit code $rc"
exit "$rc"

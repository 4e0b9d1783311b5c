#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer run of loom's test suites.
#
# Usage: bash scripts/sanitize.sh [BUILD_DIR]        (default: build-asan, beside build/)
#
# 1. Configures BUILD_DIR once (under the build lock), as a second build folder next to the normal one:
#      -Db_sanitize=address,undefined -Db_lundef=false   (ASan + UBSan; libraries stay unsanitized,
#                                                        so undefined symbols are resolved at run time)
#      -Dbenchmarks=false -Dexamples=false               (only what the tests need)
# 2. Builds the test executables only (no benchmarks, no examples), under the machine's build lock
#    (flock /tmp/loom-build.lock, the lock `lbuild` takes; taken once per executable, so other
#    builds can run in between), with ninja -j${LOOM_SANITIZE_JOBS:-2}.
# 3. Runs the unit and multi-rank suites one at a time with meson test --no-rebuild and a timeout
#    multiplier of ${LOOM_SANITIZE_TIMEOUT_MULTIPLIER:-4} (sanitized code runs 2-3x slower):
#      ASAN_OPTIONS  detect_leaks=0        LibTorch, Gloo and doctest keep process-lifetime
#                                          allocations that LeakSanitizer reports at exit;
#                    abort_on_error=1       a finding ends the process (SIGABRT), so its test fails
#      UBSAN_OPTIONS halt_on_error=1       by default UBSan prints and continues with exit code 0;
#                    print_stacktrace=1     this makes every finding fail its test, with a stack
#    Ranks started by loom::spawn inherit both variables, so findings inside ranks fail too.
#
# Exit code: 0 when every suite passed; otherwise meson test's (failing suites are listed, their
# output is in BUILD_DIR/meson-logs/testlog.txt). Prints the time each phase took.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)
build_dir=${1:-build-asan}
jobs=${LOOM_SANITIZE_JOBS:-2}
lock=${LOOM_BUILD_LOCK:-/tmp/loom-build.lock}

# The test executables and the meson test entries that run them.
targets=(tests/comm/test_comm tests/dist/test_dist tests/log/test_log tests/collate/test_collate
         tests/sample/test_sample tests/reduce/test_reduce tests/accumulate/test_accumulate
         tests/train/test_train tests/schedule/test_schedule)
suites=(comm dist log collate sample sample_dist reduce reduce-dist accumulate accumulate-dist train train-dist
        schedule schedule_rank)

start=$(date +%s)
phase() { echo "[sanitize +$(($(date +%s) - start))s] $*"; }

if [ ! -f "$build_dir/build.ninja" ]; then
  phase "configuring $build_dir"
  flock "$lock" meson setup "$build_dir" "$src" --wrap-mode=nodownload \
    -Db_sanitize=address,undefined -Db_lundef=false -Dbenchmarks=false -Dexamples=false
fi

phase "building ${#targets[@]} test executables (ninja -j$jobs, under $lock, one executable per lock hold)"
build_start=$(date +%s)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
for t in "${targets[@]}"; do  # the lock is released between executables so other builds interleave
  t_start=$(date +%s)
  flock "$lock" ninja -C "$build_dir" -j"$jobs" "$t"
  phase "  $t: $(($(date +%s) - t_start)) s (lock wait included)"
done
phase "build took $(($(date +%s) - build_start)) s"

# Only the suites whose test entry exists in this configuration (e.g. no Gloo: no *_dist).
available=$(meson test -C "$build_dir" --list --no-rebuild 2>/dev/null | sed -n 's#^loom / ##p')
run=()
for s in "${suites[@]}"; do
  if grep -qx -- "$s" <<<"$available"; then run+=("$s"); else phase "suite $s not defined in this build, skipped"; fi
done

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
phase "running ${run[*]} (ASAN_OPTIONS=$ASAN_OPTIONS UBSAN_OPTIONS=$UBSAN_OPTIONS)"
test_start=$(date +%s)
rc=0
meson test -C "$build_dir" --no-rebuild --print-errorlogs --num-processes 1 \
  --timeout-multiplier "${LOOM_SANITIZE_TIMEOUT_MULTIPLIER:-4}" "${run[@]}" || rc=$?
phase "tests took $(($(date +%s) - test_start)) s; exit code $rc"
exit "$rc"

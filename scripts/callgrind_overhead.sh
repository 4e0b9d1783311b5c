#!/usr/bin/env bash
# Composition overhead of loom::Accumulator + loom::Reducer, by instruction count under callgrind
# (deterministic, unlike wall time on a shared machine).
#
# Runs `bench_reduce --overhead=loom` and `--overhead=hand` (then trainer / lowlevel and recorder /
# norecorder) under valgrind --tool=callgrind,
# collecting only inside loom_overhead_loom_loop / loom_overhead_hand_loop (the same 40
# micro-batches of an MLP, an optimizer step every 4; see bench/bench_reduce.cpp), and prints the
# two instruction counts and their ratio. Goal: loom / hand <= 1.01.
#
# Usage: scripts/callgrind_overhead.sh [BUILD_DIR]   (default: build; builds bench/bench_reduce)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
if command -v lbuild >/dev/null && [ "$build_dir" = build ]; then lbuild bench/bench_reduce >/dev/null; else ninja -C "$build_dir" bench/bench_reduce >/dev/null; fi
exe="$build_dir/bench/bench_reduce"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Debian's libtorch pulls in libhwy (libtorch_cpu -> opencv/ffmpeg -> libjxl -> libhwy), whose
# static initialiser calls hwy::platform::TimerResolution(), which executes RDTSCP; valgrind 3.19
# stops there with SIGILL when the CPU does not advertise RDTSCP (virtual machines). A preloaded
# stand-in for that one function (it only calibrates a timer) lets the program start under valgrind.
preload=""
if ldd "$exe" | grep -q libhwy; then
  printf '#include <stdint.h>\nuint64_t _ZN3hwy8platform15TimerResolutionEv(void) { return 1; }\n' >"$out/hwy_timer.c"
  cc -shared -fPIC -O1 -o "$out/hwy_timer.so" "$out/hwy_timer.c"
  preload="$out/hwy_timer.so"
fi

count() {  # $1 = loom | hand
  local fn="loom_overhead_$1_loop"
  LD_PRELOAD="$preload" OMP_NUM_THREADS=1 valgrind --tool=callgrind --collect-atstart=no --toggle-collect="$fn" \
    --callgrind-out-file="$out/$1.out" "$exe" --overhead="$1" >"$out/$1.log" 2>&1 || {
    cat "$out/$1.log" >&2
    exit 1
  }
  # "events: Ir" then "summary: N" in the output file.
  awk '/^summary:/ {print $2}' "$out/$1.out"
}

compare() {  # WITH BASELINE WITH_LABEL BASELINE_LABEL RATIO_LABEL: counts both loops, prints the ratio
  local with base ratio
  with=$(count "$1")
  base=$(count "$2")
  ratio=$(awk -v a="$with" -v b="$base" 'BEGIN {printf "%.4f", a / b}')
  printf '  %-22s: %14s\n' "$4" "$base" "$3" "$with"
  echo "  ratio $5: $ratio (goal <= 1.01)"
  awk -v r="$ratio" 'BEGIN {exit !(r <= 1.01)}' && echo "  goal met" || echo "  goal NOT met"
}

echo "instructions (Ir) in the measured loop:"
compare loom hand "accumulator+reducer" "hand-written loop" "loom / hand"
# The short path (loom::Trainer + BatchLoader) against the same protocol written over the
# low-level layer (GlobalBatchSampler + collate_sampled + Accumulator + Reducer): one epoch of
# 48 batches of 32, 4 batches per step, after a warm-up epoch.
compare trainer lowlevel "loom::Trainer loop" "low-level loop" "trainer / low-level"
# The flight recorder (docs/debugging.md): the same Trainer loop over a GlooCommunicator of one rank,
# GlooOptions::flight_recorder on against off. Counts the training thread (the recorder's work is
# there: one entry, the fingerprint fold and three state changes per collective).
compare recorder norecorder "Gloo, recorder on" "Gloo, recorder off" "recorder on / off"

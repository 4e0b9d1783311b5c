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

loom=$(count loom)
hand=$(count hand)
ratio=$(awk -v a="$loom" -v b="$hand" 'BEGIN {printf "%.4f", a / b}')
echo "instructions (Ir) in the measured loop:"
printf '  hand-written loop : %15s\n' "$hand"
printf '  accumulator+reducer: %14s\n' "$loom"
echo "  ratio loom / hand  : $ratio (goal <= 1.01)"
awk -v r="$ratio" 'BEGIN {exit !(r <= 1.01)}' && echo "goal met" || echo "goal NOT met"
# The short path (loom::Trainer + BatchLoader) against the same protocol written over the
# low-level layer (GlobalBatchSampler + collate_sampled + Accumulator + Reducer): one epoch of
# 48 batches of 32, 4 batches per step, after a warm-up epoch.
trainer=$(count trainer)
lowlevel=$(count lowlevel)
ratio2=$(awk -v a="$trainer" -v b="$lowlevel" 'BEGIN {printf "%.4f", a / b}')
printf '  low-level loop      : %14s\n' "$lowlevel"
printf '  loom::Trainer loop  : %14s\n' "$trainer"
echo "  ratio trainer / low-level: $ratio2 (goal <= 1.01)"
awk -v r="$ratio2" 'BEGIN {exit !(r <= 1.01)}' && echo "goal met" || echo "goal NOT met"
# The flight recorder (docs/debugging.md): the same Trainer loop over a GlooCommunicator of one rank,
# GlooOptions::flight_recorder on against off. Counts the training thread (the recorder's work is
# there: one entry, the fingerprint fold and three state changes per collective).
recorder=$(count recorder)
norecorder=$(count norecorder)
ratio3=$(awk -v a="$recorder" -v b="$norecorder" 'BEGIN {printf "%.4f", a / b}')
printf '  Gloo, recorder off  : %14s\n' "$norecorder"
printf '  Gloo, recorder on   : %14s\n' "$recorder"
echo "  ratio recorder on / off: $ratio3 (goal <= 1.01)"
awk -v r="$ratio3" 'BEGIN {exit !(r <= 1.01)}' && echo "goal met" || echo "goal NOT met"

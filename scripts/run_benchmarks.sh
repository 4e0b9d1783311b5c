#!/usr/bin/env bash
# Runs every CPU benchmark suite once, one after another, and keeps what docs/benchmarks.md reports.
#
# Usage: scripts/run_benchmarks.sh [BUILD_DIR] [OUTDIR]     (defaults: build-torch2, bench-results)
# Writes OUTDIR/<suite>.txt (console output, RATIO lines at the end), OUTDIR/<suite>.json (every
# repetition, Google Benchmark JSON; bench_ops has none), OUTDIR/load.txt (uptime before and after
# each suite), OUTDIR/commit.txt, the figures OUTDIR/reduce_sweep.png, OUTDIR/collate_sweep.png
# (scripts/plot_benchmarks.sh) and OUTDIR/time_to_accuracy.png (scripts/plot_time_to_accuracy.sh,
# from bench_finetune's curves), and last OUTDIR/results.md: every RATIO line with its goal, met or
# not, the load and the timings, as markdown (scripts/bench_tables.py; docs/benchmarks.md's tables).
# Run it on a quiet machine: nothing else building, load average under 1.5 (it warns otherwise);
# the figures in docs/benchmarks.md quote the load next to each table. A suite keeps both cores
# busy (bench_reduce's two ranks), so before each suite the script waits until the 1-minute load
# average is below LOOM_BENCH_QUIET_LOAD (default 1.0) or LOOM_BENCH_QUIET_WAIT seconds have passed
# (default 300), and writes the seconds it waited to load.txt.
# Time: about 26 minutes on 2 cores, waits included (bench_finetune alone about 14).
# LOOM_BENCH_SUITES="reduce ops" runs only the suites named (reduce collate schedule generators comm
# ops plan recovery loader finetune); results.md then holds those.
set -euo pipefail
build=${1:-build-torch2}
out=${2:-bench-results}
mkdir -p "$out"
bench="$build/bench"
[ -x "$bench/bench_reduce" ] || { echo "no $bench/bench_reduce: build with -Dbenchmarks=true first" >&2; exit 1; }
: > "$out/load.txt"
load() { echo "$1 $2: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/load.txt"; }
warn_if_loaded() {
  local l
  l=$(cut -d' ' -f1 /proc/loadavg)
  if awk -v l="$l" 'BEGIN{exit !(l >= 1.5)}'; then echo "warning: load average $l >= 1.5: the figures will be noisy" >&2; fi
}
quiet_load=${LOOM_BENCH_QUIET_LOAD:-1.0}
quiet_wait=${LOOM_BENCH_QUIET_WAIT:-300}
[[ "$quiet_load" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "LOOM_BENCH_QUIET_LOAD=$quiet_load: not a number" >&2; exit 1; }
[[ "$quiet_wait" =~ ^[0-9]+$ ]] || { echo "LOOM_BENCH_QUIET_WAIT=$quiet_wait: not a whole number of seconds" >&2; exit 1; }
wait_quiet() {  # lets the previous suite's load decay (the 1-minute average falls by e in 60 s)
  local waited=0 l
  while l=$(cut -d' ' -f1 /proc/loadavg) && awk -v l="$l" -v q="$quiet_load" 'BEGIN{exit !(l >= q)}'; do
    if [ "$waited" -ge "$quiet_wait" ]; then
      echo "$1 gave up waiting after ${waited} s at load $l" >> "$out/load.txt"
      echo "warning: load $l still >= $quiet_load after ${waited} s; running $1 anyway" >&2
      return
    fi
    sleep 5
    waited=$((waited + 5))
  done
  echo "$1 waited ${waited} s for the load to fall" >> "$out/load.txt"
}
suites=${LOOM_BENCH_SUITES:-}  # e.g. "reduce ops": only those suites (default: every suite)
run() {  # run NAME COMMAND...
  local name=$1; shift
  if [ -n "$suites" ] && [[ " $suites " != *" $name "* ]]; then return 0; fi
  wait_quiet "$name"
  warn_if_loaded
  load "$name" before
  echo "== $name: $*" | tee "$out/$name.txt"
  "$@" 2>&1 | tee -a "$out/$name.txt"
  load "$name" after
}
git -C "$(dirname "$0")/.." rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null || true
run reduce "$bench/bench_reduce" --benchmark_out="$out/reduce.json" --benchmark_out_format=json
run collate "$bench/bench_collate" --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true \
  --benchmark_out="$out/collate.json" --benchmark_out_format=json
run schedule "$bench/bench_schedule" --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true \
  --benchmark_out="$out/schedule.json" --benchmark_out_format=json
[ -x "$bench/bench_generators" ] && run generators "$bench/bench_generators" --benchmark_repetitions=5 \
  --benchmark_enable_random_interleaving=true --benchmark_out="$out/generators.json" --benchmark_out_format=json
run comm "$bench/bench_comm" --benchmark_out="$out/comm.json" --benchmark_out_format=json
[ -x "$bench/bench_ops" ] && run ops "$bench/bench_ops"
run plan "$bench/bench_plan" --benchmark_out="$out/plan.json" --benchmark_out_format=json
[ -x "$bench/bench_recovery" ] && run recovery "$bench/bench_recovery" --benchmark_out="$out/recovery.json" \
  --benchmark_out_format=json
[ -x "$bench/bench_loader" ] && run loader "$bench/bench_loader" --benchmark_repetitions=5 \
  --benchmark_enable_random_interleaving=true --benchmark_out="$out/loader.json" --benchmark_out_format=json
[ -x "$bench/bench_finetune" ] && run finetune "$bench/bench_finetune" --target=0.48 --max-epochs=10 \
  --curve="$out/finetune_curve.csv" --benchmark_out="$out/finetune.json" --benchmark_out_format=json
if command -v gnuplot >/dev/null; then
  if [ -f "$out/reduce.json" ] && [ -f "$out/collate.json" ]; then
    "$(dirname "$0")/plot_benchmarks.sh" "$out" "$out/reduce.json" "$out/collate.json"
  fi
  [ -f "$out/finetune_curve.csv" ] &&
    "$(dirname "$0")/plot_time_to_accuracy.sh" "$out/finetune_curve.csv" "$out/time_to_accuracy.png" 0.48
else
  echo "gnuplot not installed: no figures (apt-get install gnuplot-nox)" >&2
fi
python3 "$(dirname "$0")/bench_tables.py" "$out" > "$out/results.md"
echo "wrote $out/results.md"

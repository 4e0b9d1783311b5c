#!/usr/bin/env bash
# Draws how cost grows with size from Google Benchmark JSON files, as PNG figures (gnuplot).
#
#   bench_reduce's sweep/{flat,loom}/params:N  -> OUTDIR/reduce_sweep.png: milliseconds per
#       all-reduce step against the model's parameters (log-log), loom and one flat all-reduce of
#       the same bytes, and loom's speed relative to flat (right axis; goal >= 0.9)
#   bench_collate's sweep/{memcpy,loom}/batch:N (when given) -> OUTDIR/collate_sweep.png: the same
#       against the batch size, loom against the memcpy floor
# Each point is the median over the file's repetitions; the whiskers are the min and max.
#
# Usage: scripts/plot_benchmarks.sh OUTDIR REDUCE_JSON [COLLATE_JSON]
#   make the JSON with: build/bench/bench_reduce --benchmark_filter=sweep --benchmark_out=reduce.json --benchmark_out_format=json
# Needs gnuplot (Debian: gnuplot-nox, installed by scripts/setup.sh) and python3.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUTDIR REDUCE_JSON [COLLATE_JSON]" >&2
  exit 2
fi
out=$1
mkdir -p "$out"
command -v gnuplot >/dev/null || { echo "gnuplot is not installed (apt-get install gnuplot-nox)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# extract JSON PREFIX_A PREFIX_B PARAM -> rows "size medA minA maxA medB minB maxB ratio_median"
extract() {
  python3 - "$@" <<'EOF'
import json, re, statistics, sys
path, a, b, param = sys.argv[1:5]
runs = {}
for bm in json.load(open(path)).get("benchmarks", []):
    if bm.get("run_type") != "iteration" or bm.get("error_occurred"):
        continue
    m = re.match(r"(.*)/%s:(\d+)" % re.escape(param), bm.get("run_name", bm["name"]))
    if not m:
        continue
    ms = bm["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[bm.get("time_unit", "ns")]
    runs.setdefault((m.group(1), int(m.group(2))), []).append(ms)
sizes = sorted({s for (_, s) in runs})
for s in sizes:
    ta, tb = runs.get((a, s), []), runs.get((b, s), [])
    if not ta or not tb:
        continue
    ratios = [x / y for x, y in zip(ta, tb)]
    print(s, statistics.median(ta), min(ta), max(ta), statistics.median(tb), min(tb), max(tb), statistics.median(ratios))
EOF
}

plot() {  # DAT PNG XLABEL BASE_NAME TITLE
  gnuplot <<EOF
set terminal pngcairo size 900,560 font ",11"
set output "$2"
set title "$5"
set logscale x
set logscale y
set xlabel "$3"
set ylabel "milliseconds per step (median; bars: min, max)"
set y2label "loom speed relative to $4 (median of per-repetition ratios)"
set y2range [0:1.5]
set y2tics
set ytics nomirror
set key top left
set grid
plot "$1" using 1:2:3:4 with yerrorlines title "$4", \
     "$1" using 1:5:6:7 with yerrorlines title "loom", \
     "$1" using 1:8 axes x1y2 with linespoints dashtype 2 title "$4 time / loom time", \
     0.9 axes x1y2 with lines dashtype 3 lc rgb "gray" title "goal 0.9"
EOF
}

extract "$2" sweep/flat sweep/loom params >"$tmp/reduce.dat"
if [ -s "$tmp/reduce.dat" ]; then
  plot "$tmp/reduce.dat" "$out/reduce_sweep.png" "float32 parameters" "flat all-reduce" \
    "Gradient reduction over Gloo, 2 ranks: loom vs one flat all-reduce of the same bytes"
  echo "wrote $out/reduce_sweep.png"
  column -t "$tmp/reduce.dat"
else
  echo "no sweep/flat and sweep/loom runs in $2" >&2
fi
if [ $# -ge 3 ]; then
  extract "$3" sweep/memcpy sweep/loom batch >"$tmp/collate.dat"
  if [ -s "$tmp/collate.dat" ]; then
    plot "$tmp/collate.dat" "$out/collate_sweep.png" "samples per batch" "memcpy" \
      "Collation: loom vs a memcpy of the same bytes"
    echo "wrote $out/collate_sweep.png"
    column -t "$tmp/collate.dat"
  else
    echo "no sweep/memcpy and sweep/loom runs in $3" >&2
  fi
fi

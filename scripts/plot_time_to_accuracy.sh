#!/usr/bin/env bash
# Draws bench_finetune's time-to-accuracy curves as a PNG (gnuplot): validation accuracy against
# seconds of training, one panel per number of ranks, one colour per way, one line per run, and
# the target accuracy as a dashed line.
#
# Usage: scripts/plot_time_to_accuracy.sh CURVE_CSV OUT_PNG [TARGET]
#   make the CSV with: build/bench/bench_finetune --curve=curve.csv   (columns: way, ranks, run,
#   samples, seconds, accuracy; one row per evaluation)
# Needs gnuplot (Debian: gnuplot-nox, installed by scripts/setup.sh) and python3.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 CURVE_CSV OUT_PNG [TARGET]" >&2
  exit 2
fi
csv=$1
out=$2
target=${3:-0.45}
command -v gnuplot >/dev/null || { echo "gnuplot is not installed (apt-get install gnuplot-nox)" >&2; exit 1; }
[ -f "$csv" ] || { echo "$csv: no such file" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One data file per (ranks, way): blocks of "seconds accuracy" per run, separated by blank lines.
python3 - "$csv" "$tmp" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
if not rows:
    sys.exit(f"{sys.argv[1]}: no rows")
series = {}
for r in rows:
    series.setdefault((int(r["ranks"]), r["way"]), {}).setdefault(int(r["run"]), []).append(
        (float(r["seconds"]), float(r["accuracy"])))
for (ranks, way), runs in series.items():
    with open(f"{sys.argv[2]}/r{ranks}_{way}.dat", "w") as f:
        for run in sorted(runs):
            for s, a in sorted(runs[run]):
                f.write(f"{s} {a}\n")
            f.write("\n\n")
EOF

ranks=$(ls "$tmp" | sed -n 's/^r\([0-9]*\)_.*/\1/p' | sort -un)
n=$(echo "$ranks" | wc -w)
{
  echo "set terminal pngcairo size $((560 * n)),420 font ',10'"
  echo "set output '$out'"
  echo "set multiplot layout 1,$n"
  echo "set xlabel 'seconds of training (evaluation excluded)'"
  echo "set ylabel 'validation accuracy'"
  echo "set termoption noenhanced"
  echo "set key bottom right"
  echo "set grid"
  for r in $ranks; do
    echo "set title '$r rank(s), 32 samples per optimizer step'"
    plot="plot $target with lines dashtype 2 lc rgb 'black' title 'target $target'"
    i=1
    for way in loom group_in_batch accumulate_32 one_at_a_time; do
      f="$tmp/r${r}_${way}.dat"
      [ -f "$f" ] || continue
      plot="$plot, '$f' using 1:2 with linespoints lw 1.5 pt 7 ps 0.4 lc $i title '$way'"
      i=$((i + 1))
    done
    echo "$plot"
  done
  echo "unset multiplot"
} >"$tmp/plot.gp"
gnuplot "$tmp/plot.gp"
echo "wrote $out"

#!/bin/bash
# elastic_stress.sh [RUNS] [BUILD] — kills a random rank at a random optimizer step in RUNS (default
# 20) runs of examples/finetune_icons --nproc 3 --elastic 2 --deterministic (a short fine-tune) and
# checks that each ends with the weights_fnv1a of the run nobody killed. Prints one line per run;
# exits 1 when a run differs or does not finish. Needs BUILD (default build-torch2) with the
# examples built. About 3 s a run on 2 cores. docs/elastic.md.
set -uo pipefail
runs=${1:-20}
build=${2:-build-torch2}
ex="$build/examples/finetune_icons"
[ -x "$ex" ] || { echo "elastic_stress: no $ex (build the examples first)" >&2; exit 2; }
args="--nproc 3 --subset 4 --epochs 1 --pretrain-epochs 1 --deterministic --elastic 2"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
want=$("$ex" $args --out "$dir/ref" 2>&1 | grep -o 'weights_fnv1a=[0-9a-f]*')
[ -n "$want" ] || { echo "elastic_stress: the run nobody killed printed no weights_fnv1a" >&2; exit 1; }
echo "nobody killed: $want"
RANDOM=${LOOM_STRESS_SEED:-51}
failed=0
for i in $(seq 1 "$runs"); do
  rank=$((RANDOM % 3))
  step=$((1 + RANDOM % 6))
  out=$("$ex" $args --kill-rank "$rank" --kill-at-step "$step" --out "$dir/run$i" 2>&1)
  got=$(echo "$out" | grep -o 'weights_fnv1a=[0-9a-f]*')
  line=$(echo "$out" | grep -o 'recovered: rank [0-9]* died at step [0-9]*.*' | head -1)
  if [ "$got" = "$want" ]; then verdict=same; else verdict=DIFFERENT; failed=1; fi
  echo "run $i: rank $rank killed at step $step -> ${line:-no recovery line}; ${got:-no result} $verdict"
done
exit $failed

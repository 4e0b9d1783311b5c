#!/usr/bin/env bash
# loom's GPU check: one short, complete run on a machine with an NVIDIA GPU whose python3 holds a
# CUDA build of torch 2.x (plus meson, ninja, cmake, a C++20 g++). Finishes in under 8 minutes.
#
# Usage:  bash scripts/device-check.sh OUTDIR
#   (through the device tool: command "bash scripts/device-check.sh $OUT", carry [".device-deps"]
#    after `bash scripts/device-deps.sh` here, timeout_s 540)
#
# What it does, each step logged and timed, continuing past a failing step:
#   1. inventory: GPU, driver, torch / CUDA / NCCL versions, compilers, tools
#   2. dependencies: unpacks .device-deps/*.deb (if carried) under /tmp and points the build at them
#   3. CUDA runtime and NCCL: the toolkit (/usr/local/cuda) and the NCCL that torch itself loads
#      (pip's nvidia-nccl wheel), through a small shim folder when the wheels lack unversioned .so
#   4. configure loom against torch (-Dtorch_dir, -Dtorch_cxx11_abi from torch._C)
#   5. build tests/gpu (host + device tests) and bench/bench_gpu
#   6. run: host tests; device tests one group at a time (NCCL all-reduce for every dtype at world
#      size 1, stream ordering, launcher rendezvous, timeouts, two ranks on one GPU, pinned memory,
#      H2D copies, collation into pinned memory, NCCL on CUDA tensors, transfer_batch, scheduler +
#      CudaTransfer, reducer + accumulator exactness over NCCL, the short path over NCCL vs Gloo on
#      one GPU); bench_gpu (H2D throughput vs plain pinned cudaMemcpyAsync, goal >= 0.9x);
#      bench_reduce --cuda (the reducer vs a flat NCCL all-reduce with the same averaging and
#      inf/NaN check, goal >= 0.9x); bench_ops --cuda (operators, kernels and host reads per
#      optimizer step, loom::Trainer against the plain loop, float and deterministic); finetune_icons over NCCL and over Gloo on the same GPU (losses
#      within 1e-5); bench_finetune --device=cuda (time to accuracy, loom vs the DDP-style loops);
#      last, if time is left, loom's CPU reducer suite
# Output (at most 5 files, the device tool brings back 8): OUTDIR/results.md (the table),
# OUTDIR/device-check.log (every step's full output), OUTDIR/bench_gpu.json,
# OUTDIR/bench_reduce_cuda.json, OUTDIR/bench_finetune_cuda.json.
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
SRC=$(pwd)
START=$(date +%s)
BUDGET=${LOOM_DEVICE_CHECK_BUDGET:-470}   # seconds; the whole script stays under 8 minutes
DEADLINE=$((START + BUDGET))
WORK=$(mktemp -d /tmp/loom-device-check.XXXXXX)
LOG="$OUTDIR/device-check.log"
RESULTS="$OUTDIR/results.md"
BUILD=${LOOM_DEVICE_CHECK_BUILD:-$WORK/build}   # override to reuse a build folder
JOBS=$(nproc 2>/dev/null || echo 8)
: >"$LOG"
ROWS=()
LAST_RC=0

elapsed() { echo $(($(date +%s) - START)); }
log() { echo "[device-check +$(elapsed)s] $*" | tee -a "$LOG"; }
record() {  # name status seconds detail
  ROWS+=("| $1 | $2 | $3 | ${4//|//} |")
  write_results
}
write_results() {
  {
    echo "# loom device check"
    echo
    echo "Started $(date -u -d "@$START" '+%Y-%m-%d %H:%M:%S UTC' 2>/dev/null || date -u), $(elapsed) s so far; commit $(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo '?')."
    echo
    for line in "${INVENTORY[@]}"; do echo "- $line"; done
    echo
    echo "| step | status | seconds | detail |"
    echo "|---|---|---|---|"
    for row in "${ROWS[@]}"; do echo "$row"; done
    if [ -n "${BENCH_TABLE:-}" ]; then
      echo
      echo "$BENCH_TABLE"
    fi
  } >"$RESULTS"
}
INVENTORY=()

# step NAME TIMEOUT_S COMMAND... — runs COMMAND with a timeout clipped to the time left, appends
# its output to the log, records ok / FAIL / TIMEOUT / SKIPPED (exit 77) and never fails itself.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 15 ]; then
    log "--- $name: not run, the time budget is spent"
    record "$name" "NOT RUN (time budget)" 0 ""
    return 0
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  log "--- $name (limit ${limit}s): $*"
  local s rc=0
  s=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$WORK/step.log" 2>&1 || rc=$?
  local d=$(($(date +%s) - s))
  cat "$WORK/step.log" >>"$LOG"
  local status detail
  case $rc in
    0) status=ok ;;
    77) status=SKIPPED ;;
    124 | 137) status="TIMEOUT (${limit}s)" ;;
    *) status="FAIL (exit $rc)" ;;
  esac
  detail=$(step_detail "$name" "$rc")
  log "--- $name: $status in ${d}s ${detail:+($detail)}"
  record "$name" "$status" "$d" "$detail"
  LAST_RC=$rc
  return 0
}
# A one-line summary of a step's output for the table.
step_detail() {
  local f=$WORK/step.log
  case $1 in
    test:*)
      local cases asserts
      cases=$(grep -m1 -o 'test cases: *[0-9]* *| *[0-9]* passed *| *[0-9]* failed' "$f" | tr -s ' ' || true)
      asserts=$(grep -m1 -o 'assertions: *[0-9]* *| *[0-9]* passed *| *[0-9]* failed' "$f" | tr -s ' ' || true)
      local extra
      extra=$(grep -m3 -E 'RESULT|SKIP:|ERROR:|threw|MESSAGE' "$f" | tr '\n' ' ' | cut -c1-300 || true)
      if [ -n "$cases" ]; then echo "$cases; $asserts ${extra}"; else echo "$extra"; fi
      ;;
    *) [ "$2" -ne 0 ] && tail -n 3 "$f" | tr '\n' ' ' | cut -c1-300 || true ;;
  esac
}

log "loom device check in $SRC, output in $OUTDIR, budget ${BUDGET}s, $JOBS jobs"

# ---- 1. inventory --------------------------------------------------------------------------
PY=${PYTHON:-python3}
# One python start (importing torch takes seconds): torch's folder, ABI, versions, nvidia wheels.
"$PY" - >"$WORK/torch.env" 2>>"$LOG" <<'EOF' || true
import os
try:
    import torch
    print("TORCH_DIR=" + os.path.dirname(torch.__file__))
    print("ABI=" + ("true" if torch._C._GLIBCXX_USE_CXX11_ABI else "false"))
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "?"
    print(f"TORCH_INFO='torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}, "
          f"cuda available {torch.cuda.is_available()}, {torch.cuda.device_count()} device(s))'")
except Exception as e:
    print(f"TORCH_INFO='torch not importable: {type(e).__name__}'")
try:
    import nvidia
    print("NVIDIA_DIRS='" + " ".join(nvidia.__path__) + "'")
except Exception:
    pass
EOF
TORCH_DIR="" ABI=auto TORCH_INFO="torch: ?" NVIDIA_DIRS=""
# shellcheck disable=SC1091
. "$WORK/torch.env"
inventory() {
  echo "## uname"; uname -a
  echo "## nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || nvidia-smi -L || true
  echo "## tools"
  for t in g++ c++ clang++ nvcc meson ninja cmake pkg-config ccache; do
    printf '%s: ' "$t"; (command -v "$t" && "$t" --version 2>&1 | head -1) | tr '\n' ' '; echo
  done
  echo "## headers already present"
  for h in fmt/format.h range/v3/all.hpp doctest/doctest.h benchmark/benchmark.h png.h zlib.h CLI/CLI.hpp; do
    printf '%s: ' "$h"; (echo "#include <$h>" | ${CXX:-g++} -std=c++20 -fsyntax-only -x c++ - >/dev/null 2>&1 && echo yes) || echo no
  done
  ls -d /usr/local/cuda* 2>/dev/null || true
}
step inventory 45 bash -c "$(declare -f inventory); inventory"
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo '?')
INVENTORY+=("GPU: ${GPU:-none seen by nvidia-smi}" "$TORCH_INFO" "torch folder: ${TORCH_DIR:-none (system LibTorch)}, CXX11 ABI: $ABI")

# ---- 2. carried dependencies -----------------------------------------------------------------
DEPS=$WORK/deps
if ls .device-deps/*.deb >/dev/null 2>&1; then
  mkdir -p "$DEPS"
  for f in .device-deps/*.deb; do dpkg -x "$f" "$DEPS" || log "dpkg -x $f failed"; done
  # Debian's .pc files say prefix=/usr: make them point into the unpacked tree.
  find "$DEPS" -name '*.pc' -exec sed -i -e "s|=/usr|=$DEPS/usr|g" {} +
  # CMake target files with a hard-coded /usr prefix (doctest's), likewise.
  grep -rl '_IMPORT_PREFIX "/usr"' "$DEPS" 2>/dev/null | xargs -r sed -i "s|_IMPORT_PREFIX \"/usr\"|_IMPORT_PREFIX \"$DEPS/usr\"|"
  # Absolute symlinks (libz.so -> /lib/x86_64-linux-gnu/libz.so.1.2.13) into the unpacked tree.
  find "$DEPS" -type l | while read -r link; do
    target=$(readlink "$link")
    case $target in /*) if [ -e "$DEPS$target" ]; then ln -sfn "$DEPS$target" "$link"; fi ;; esac
  done
  multi=$DEPS/usr/lib/x86_64-linux-gnu
  export PKG_CONFIG_PATH="$multi/pkgconfig:$DEPS/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export CMAKE_PREFIX_PATH="$DEPS/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export CPATH="$DEPS/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$multi${LIBRARY_PATH:+:$LIBRARY_PATH}"
  # At run time only the libraries the image cannot have (fmt 9, benchmark 1.7): a carried zlib or
  # libpng must not shadow the image's newer ones for python, cmake and meson.
  mkdir -p "$DEPS/rt"
  for l in "$multi"/libfmt.so.* "$multi"/libbenchmark*.so.*; do if [ -e "$l" ]; then ln -sf "$l" "$DEPS/rt/"; fi; done
  export LD_LIBRARY_PATH="$DEPS/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  record dependencies ok 0 "unpacked $(ls .device-deps/*.deb | wc -l) carried .deb files"
else
  record dependencies "none carried" 0 "using the image's libraries (run scripts/device-deps.sh here and carry .device-deps if configure fails)"
fi

# ---- 3. CUDA runtime and NCCL ---------------------------------------------------------------
SHIM=$WORK/shim
first_file() {  # NAME DIRS... -> first match of NAME under DIRS (depth <= 5)
  local name=$1
  shift
  for d in "$@"; do
    [ -d "$d" ] || continue
    local f
    f=$(find -L "$d" -maxdepth 5 -name "$name" 2>/dev/null | sort | head -1)
    [ -n "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}
make_root() {  # ROOT HEADER_FILE LIBRARY_FILE LIBNAME: a toolkit-like root with include/ and lib64/
  mkdir -p "$1/lib64"
  if [ ! -e "$1/include" ]; then ln -s "$(dirname "$2")" "$1/include"; fi
  ln -sf "$3" "$1/lib64/lib$4.so"
  ln -sf "$3" "$1/lib64/$(basename "$3")"
}
CUDA_ROOT=""
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-12 /opt/cuda; do
  [ -n "$d" ] && [ -f "$d/include/cuda_runtime_api.h" ] || continue
  if ls "$d"/lib64/libcudart.so >/dev/null 2>&1 || ls "$d"/lib/libcudart.so >/dev/null 2>&1; then
    CUDA_ROOT=$d
    break
  fi
done
if [ -z "$CUDA_ROOT" ]; then
  h=$(first_file cuda_runtime_api.h $NVIDIA_DIRS || true)
  l=$(first_file 'libcudart.so*' $NVIDIA_DIRS || true)
  if [ -n "$h" ] && [ -n "$l" ]; then
    make_root "$SHIM/cuda" "$h" "$l" cudart
    CUDA_ROOT=$SHIM/cuda
  fi
fi
NCCL_H=$(first_file nccl.h $NVIDIA_DIRS || true)
NCCL_L=$(first_file 'libnccl.so*' $NVIDIA_DIRS || true)
NCCL_ROOT=""
if [ -n "$NCCL_H" ] && [ -n "$NCCL_L" ]; then
  # The NCCL torch itself loads: one libnccl.so.2 in the process, matching torch's.
  make_root "$SHIM/nccl" "$NCCL_H" "$NCCL_L" nccl
  NCCL_ROOT=$SHIM/nccl
elif [ -n "$CUDA_ROOT" ] && [ -f "$CUDA_ROOT/include/nccl.h" ]; then
  NCCL_ROOT=$CUDA_ROOT
fi
INVENTORY+=("CUDA runtime for loom: ${CUDA_ROOT:-not found}; NCCL: ${NCCL_ROOT:-not found} (${NCCL_L:-no wheel library})")
log "CUDA_ROOT=$CUDA_ROOT NCCL_ROOT=$NCCL_ROOT TORCH_DIR=$TORCH_DIR ABI=$ABI"
if [ -n "$CUDA_ROOT" ]; then
  export CUDA_HOME=${CUDA_HOME:-$CUDA_ROOT}
  if [ -d "$CUDA_ROOT/bin" ]; then export PATH="$PATH:$CUDA_ROOT/bin"; fi
  export LD_LIBRARY_PATH="$CUDA_ROOT/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ -n "$NCCL_ROOT" ]; then export LD_LIBRARY_PATH="$NCCL_ROOT/lib64:${LD_LIBRARY_PATH:-}"; fi
if [ -n "$TORCH_DIR" ]; then export LD_LIBRARY_PATH="$TORCH_DIR/lib:${LD_LIBRARY_PATH:-}"; fi
# NCCL on one machine: bootstrap over loopback; say why when it refuses something.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export CXX=${CXX:-$(command -v g++ || command -v c++ || echo g++)}

# ---- 4. configure ---------------------------------------------------------------------------
# Through scripts/cuda-configure.sh, the configuration scripts/cuda-link-check.sh proves on the CPU
# machine: the CUDA runtime and NCCL from the nvidia/ folders pip put beside torch (Meson's default).
# Only where torch has no such folders do the roots found above (a toolkit, or a shim over the wheels'
# versioned libraries) go in by hand.
meson_args=(-Dexamples=false -Dbenchmarks=true -Dtests=true)
WHEEL_NVIDIA="${TORCH_DIR:+$TORCH_DIR/../nvidia}"
if [ -z "$WHEEL_NVIDIA" ] || ! ls "$WHEEL_NVIDIA"/cu1*/include/cuda_runtime_api.h >/dev/null 2>&1; then
  if [ -n "$CUDA_ROOT" ]; then meson_args+=("-Dcudatoolkit_dir=$CUDA_ROOT"); fi
fi
if [ -z "$WHEEL_NVIDIA" ] || [ ! -f "$WHEEL_NVIDIA/nccl/include/nccl.h" ]; then
  if [ -n "$NCCL_ROOT" ]; then meson_args+=("-Dnccl_dir=$NCCL_ROOT"); fi
fi
CONF_SRC=$SRC
step configure 150 bash "$SRC/scripts/cuda-configure.sh" "$BUILD" "$PY" "${meson_args[@]}"
if [ "$LAST_RC" -ne 0 ]; then
  # Fallback: a copy of the sources whose tests/meson.build builds only the folders this check
  # needs (other folders may need libraries the image lacks, e.g. libpng for tests/examples).
  CONF_SRC=$WORK/src
  mkdir -p "$CONF_SRC"
  tar -C "$SRC" --exclude='./build*' --exclude=./.git --exclude=./.device-deps --exclude=./.venv* -cf - . | tar -C "$CONF_SRC" -xf -
  sed -i "s/^foreach d : \[.*\]/foreach d : ['gpu', 'reduce']/" "$CONF_SRC/tests/meson.build"
  rm -rf "$BUILD"
  step configure-minimal 150 bash "$CONF_SRC/scripts/cuda-configure.sh" "$BUILD" "$PY" "${meson_args[@]}"
fi
for k in "LibTorch with CUDA" "Gloo (LOOM_HAS_GLOO)" "CUDA (LOOM_HAS_CUDA)" "NCCL (LOOM_HAS_NCCL)"; do
  v=$(grep -F "$k" "$LOG" | tail -1 | sed 's/.*: *//' || true)
  INVENTORY+=("configured $k: ${v:-?}")
done

# ---- 5. build -------------------------------------------------------------------------------
targets=(tests/gpu/test_gpu_host tests/gpu/test_gpu_device bench/bench_gpu)
# bench_reduce measures Gloo too: it exists only where Gloo's headers were found (.device-deps).
if grep -q "#define LOOM_HAS_GLOO 1" "$BUILD/include/loom/build_config.hpp" 2>/dev/null; then targets+=(bench/bench_reduce bench/bench_ops); fi
if [ -f "$BUILD/build.ninja" ]; then
  step build "${LOOM_DEVICE_CHECK_BUILD_LIMIT:-240}" ninja -C "$BUILD" -k 0 -j "$JOBS" "${targets[@]}"
else
  record build "NOT RUN" 0 "configure failed; see device-check.log"
fi

# ---- 6. run ---------------------------------------------------------------------------------
HOST=$BUILD/tests/gpu/test_gpu_host
DEV=$BUILD/tests/gpu/test_gpu_device
if [ -x "$HOST" ]; then
  step "test:host" 60 "$HOST" --no-colors
else
  record "test:host" "NOT BUILT" 0 ""
fi
if [ -x "$DEV" ]; then
  groups=(
    "NCCL all_reduce at world size 1*"
    "NCCL collectives start only after*"
    "NCCL communicator on the caller's stream*"
    "NcclCommunicator from a launcher Environment*"
    "NCCL timeouts*"
    "NCCL with two processes on one GPU*"
    "pinned memory*"
    "copy_h2d_async*"
    "collation into pinned memory*"
    "NCCL on CUDA tensors*"
    "transfer_batch*"
    "GeneratorLoader with CudaTransfer*"
    "Reducer + Accumulator over NCCL*"
    "Trainer on one GPU*"
  )
  for g in "${groups[@]}"; do
    limit=60
    case $g in "NCCL with two processes"*) limit=120 ;; "NCCL timeouts"*) limit=100 ;; esac
    step "test:${g%\*}" "$limit" "$DEV" --no-colors "--test-case=$g"
  done
  { grep -h 'RESULT nccl_two_ranks_one_gpu' "$LOG" || true; } | head -1 | while read -r l; do log "$l"; done
  two=$(grep -h -m1 -o 'RESULT nccl_two_ranks_one_gpu: [a-z]*' "$LOG" || true)
  dup=$(grep -h -m1 -o -i 'Duplicate GPU[^;]*' "$LOG" || true)
  INVENTORY+=("NCCL with 2 processes on 1 GPU: ${two#RESULT nccl_two_ranks_one_gpu: }${dup:+ ($dup)}")
else
  record "test:device" "NOT BUILT" 0 ""
fi
BENCH=$BUILD/bench/bench_gpu
if [ -x "$BENCH" ]; then
  step bench_gpu 120 "$BENCH" --benchmark_min_time=0.2 "--benchmark_out=$OUTDIR/bench_gpu.json" --benchmark_out_format=json
  if [ -f "$OUTDIR/bench_gpu.json" ]; then
    BENCH_TABLE=$("$PY" - "$OUTDIR/bench_gpu.json" <<'EOF' || echo "(bench_gpu.json could not be summarised)"
import json, sys
data = json.load(open(sys.argv[1]))
rates, errors = {}, {}
for b in data.get("benchmarks", []):
    parts = b["name"].split("/")
    key = (parts[0], int(parts[1]))
    if b.get("error_occurred"):
        errors[key] = b.get("error_message", "error")
    elif "bytes_per_second" in b:
        rates[key] = b["bytes_per_second"]
names = sorted({k[0] for k in list(rates) + list(errors)}, key=lambda n: (n != "h2d_baseline_pinned_memcpy", n))
sizes = sorted({k[1] for k in list(rates) + list(errors)})
print("H2D throughput, GB/s (ratio to h2d_baseline_pinned_memcpy of the same size; goal >= 0.9x):")
print()
print("| benchmark | " + " | ".join(f"{s / 2**20:.1f} MiB" for s in sizes) + " |")
print("|---|" + "---|" * len(sizes))
for n in names:
    cells = []
    for s in sizes:
        if (n, s) in errors:
            cells.append("error: " + errors[(n, s)][:60])
        elif (n, s) in rates:
            base = rates.get(("h2d_baseline_pinned_memcpy", s))
            r = rates[(n, s)]
            cells.append(f"{r / 1e9:.2f}" + (f" ({r / base:.2f}x)" if base and n != "h2d_baseline_pinned_memcpy" else ""))
        else:
            cells.append("-")
    print(f"| {n} | " + " | ".join(cells) + " |")
EOF
)
    write_results
  fi
else
  record bench_gpu "NOT BUILT" 0 ""
fi

# ---- 6b. the reducer on the GPU against one flat NCCL all-reduce of the same bytes -------------
if [ -x "$BUILD/bench/bench_reduce" ]; then
  step "bench_reduce --cuda" 150 "$BUILD/bench/bench_reduce" --cuda "--benchmark_out=$OUTDIR/bench_reduce_cuda.json" --benchmark_out_format=json
  ratio=$(grep -h -m4 -E '^RATIO' "$WORK/step.log" | tr '\n' ' ' || true)
  INVENTORY+=("bench_reduce --cuda: ${ratio:-no RATIO line}")
else
  record "bench_reduce --cuda" "NOT BUILT" 0 ""
fi

# ---- 6b'. operators and host reads per optimizer step on the GPU (bench_ops --cuda) -------------
# Exact counts: loom::Trainer against the plain loop, float and deterministic, 160 and 1,280
# parameter tensors; kernels_extra is the launch count loom adds, items_extra and reducer_reads
# the host reads (goal: at most 1 reducer read per step in float mode).
if [ -x "$BUILD/bench/bench_ops" ]; then
  step "bench_ops --cuda" 60 "$BUILD/bench/bench_ops" --cuda --params=160,1280
  ops=$(grep -h -E '^OPS' "$WORK/step.log" | sed 's/^OPS //' | tr '\n' ';' || true)
  INVENTORY+=("bench_ops --cuda: ${ops:-no OPS line}")
else
  record "bench_ops --cuda" "NOT BUILT" 0 ""
fi

# ---- 6c. the finetune_icons loop over NCCL and over Gloo on the same GPU (world size 1) ---------
# Needs the examples (libpng from the carried .debs) and adwaita-icon-theme's files; skipped when
# either is missing or time is short. The two runs' validation and training losses must agree
# within 1e-5 relative.
ICONS=/usr/share/icons/Adwaita
[ -d "$ICONS" ] || ICONS=$DEPS/usr/share/icons/Adwaita   # from the carried adwaita-icon-theme .deb
if [ -f "$BUILD/build.ninja" ] && [ -d "$ICONS" ] && [ $((DEADLINE - $(date +%s))) -gt 200 ]; then
  step configure-examples 60 meson configure "$BUILD" -Dexamples=true
  step build-finetune 120 ninja -C "$BUILD" -k 0 -j "$JOBS" examples/finetune_icons
  FT=$BUILD/examples/finetune_icons
  if [ -x "$FT" ]; then
    ft_args=(--nproc 1 --subset 8 --epochs 1 --pretrain-epochs 0 --device cuda --data "$ICONS")
    step "finetune_icons --backend nccl" 60 "$FT" "${ft_args[@]}" --backend nccl --out "$WORK/ft_nccl"
    cp "$WORK/step.log" "$WORK/ft_nccl.log"
    step "finetune_icons --backend gloo" 60 "$FT" "${ft_args[@]}" --backend gloo --out "$WORK/ft_gloo"
    cp "$WORK/step.log" "$WORK/ft_gloo.log"
    cmp=$("$PY" - "$WORK/ft_nccl.log" "$WORK/ft_gloo.log" <<'EOF2' || true
import re, sys
def fields(path):
    for line in open(path):
        if "result:" in line:
            return {k: float(v) for k, v in re.findall(r"(\w+)=([-0-9.e+]+)", line)}
    return {}
a, b = fields(sys.argv[1]), fields(sys.argv[2])
if not a or not b:
    print("no result line in one of the runs")
    sys.exit(0)
worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in ("val_loss", "train_loss"))
print(f"finetune_icons nccl vs gloo on one GPU: val_loss {a['val_loss']} / {b['val_loss']}, "
      f"train_loss {a['train_loss']} / {b['train_loss']}, max relative difference {worst:.3g} "
      f"({'within' if worst <= 1e-5 else 'NOT within'} 1e-5)")
EOF2
)
    log "$cmp"
    INVENTORY+=("${cmp:-finetune_icons comparison: not run}")
  fi
else
  record "finetune_icons nccl vs gloo" "NOT RUN" 0 "no build, no $ICONS, or not enough time left"
fi

# ---- 6d. the main job on the GPU: bench_finetune's loom way against the DDP-style loops ---------
# Time to accuracy on one GPU over NCCL (one run each; the per-image loop is left out: thousands of
# optimizer steps an epoch). RATIO: the faster DDP-style loop's seconds to the target over loom's.
if [ -f "$BUILD/build.ninja" ] && [ -d "$ICONS" ] && [ $((DEADLINE - $(date +%s))) -gt 170 ]; then
  step build-bench-finetune 120 ninja -C "$BUILD" -k 0 -j "$JOBS" bench/bench_finetune
  if [ -x "$BUILD/bench/bench_finetune" ]; then
    step "bench_finetune --device=cuda" 150 "$BUILD/bench/bench_finetune" --device=cuda --ranks=1 --runs=1 --target=0.45 \
      --max-epochs=6 "--data=$ICONS" '--benchmark_filter=finetune/(group_in_batch|accumulate_32|loom)/' \
      "--benchmark_out=$OUTDIR/bench_finetune_cuda.json" --benchmark_out_format=json
    ratio=$(grep -h -m2 -E '^RATIO' "$WORK/step.log" | tr '\n' ' ' || true)
    INVENTORY+=("bench_finetune --device=cuda: ${ratio:-no RATIO line}")
  fi
else
  record "bench_finetune --device=cuda" "NOT RUN" 0 "no build, no $ICONS, or not enough time left"
fi

# ---- 7. last, if time is left: loom's CPU reducer suite built against this torch --------------
# (its tests have no device mode; the reducer on CUDA tensors is covered by the device tests)
if [ -f "$BUILD/build.ninja" ] && [ $((DEADLINE - $(date +%s))) -gt 120 ]; then
  step build-reduce 100 ninja -C "$BUILD" -k 0 -j "$JOBS" tests/reduce/test_reduce
  if [ "$LAST_RC" -eq 0 ] && [ -x "$BUILD/tests/reduce/test_reduce" ]; then
    step "test:reduce (CPU suite)" 60 "$BUILD/tests/reduce/test_reduce" --no-colors --test-suite-exclude=dist
  fi
else
  record build-reduce "NOT RUN (time budget)" 0 "tests/reduce (CPU reducer suite) left out to keep the GPU steps"
fi

log "done in $(elapsed)s; results in $RESULTS"
write_results
cat "$RESULTS"
rm -rf "$WORK"
exit 0

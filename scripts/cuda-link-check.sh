#!/usr/bin/env bash
# Builds loom's GPU code against the CUDA build of pip's torch 2.14.1 on a machine without a GPU,
# links it, and runs what runs without a device: the proof that scripts/device-check.sh's first GPU
# minutes go to running, not to fixing compile errors.
#
#  1. .venv-cuda/ (ignored by git): a virtual environment with torch==2.14.1 (CUDA; its NVIDIA
#     libraries, NCCL included, come with it: about 5.5 GB).
#  2. build-cuda/: configured by scripts/cuda-configure.sh (the configuration device-check.sh uses),
#     LOOM_TORCH_HAS_CUDA, LOOM_HAS_CUDA and LOOM_HAS_NCCL on.
#  3. Builds every GPU test (tests/gpu), bench_gpu, bench_reduce and bench_ops (their --cuda modes)
#     and the examples.
#  4. Checks that each program records libtorch_cuda.so and libc10_cuda.so as needed libraries
#     (readelf -d), so CUDA's kernels register at start-up.
#  5. Runs the host-side parts: the gpu_host tests; gpu_device and gpu_device_torch, which exit 77
#     (skipped) without a GPU; bench_gpu, bench_reduce --cuda and bench_ops --cuda, which say there
#     is no GPU; every
#     example's --help.
#
# Usage: scripts/cuda-link-check.sh [BUILD_DIR]   (default build-cuda; run after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build-cuda}
venv=.venv-cuda
torch_version=2.14.1
start=$(date +%s)
stamp() { echo "cuda-link-check: $* ($(( $(date +%s) - start )) s)"; }

if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  stamp "installing torch==$torch_version (CUDA) into $venv/"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$torch_version"
fi
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
if [ ! -f "$build_dir/build.ninja" ]; then
  CXX="ccache g++" bash scripts/cuda-configure.sh "$build_dir" "$venv/bin/python"
else
  bash scripts/cuda-configure.sh "$build_dir" "$venv/bin/python"
fi

programs=(tests/gpu/test_gpu_host tests/gpu/test_gpu_device bench/bench_gpu
          examples/finetune_icons examples/generators_to_devices examples/fashion_mnist_multiscale examples/readme_loop)
# bench_reduce measures Gloo too: built only where Gloo's headers were found (libgloo-dev).
has_gloo=0
if grep -q "#define LOOM_HAS_GLOO 1" "$build_dir/include/loom/build_config.hpp"; then
  has_gloo=1
  programs+=(bench/bench_reduce bench/bench_ops)
fi
stamp "building ${programs[*]}"
ninja -C "$build_dir" -j "${LOOM_BUILD_JOBS:-2}" "${programs[@]}"

failures=0
for p in "${programs[@]}"; do
  needed=$(readelf -d "$build_dir/$p" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
  for lib in libtorch_cuda.so libc10_cuda.so; do
    case " $needed " in
      *" $lib "*) ;;
      *) echo "cuda-link-check: $p does not need $lib (NEEDED: $needed)" >&2; failures=$((failures + 1)) ;;
    esac
  done
done
stamp "every program needs libtorch_cuda.so and libc10_cuda.so: $([ $failures -eq 0 ] && echo yes || echo NO)"

run() {  # NAME EXPECTED_CODES COMMAND...: runs COMMAND, accepts an exit code among EXPECTED_CODES
  local name=$1 expected=$2 rc=0
  shift 2
  "$@" >"/tmp/cuda-link-check.$$.log" 2>&1 || rc=$?
  if [[ " $expected " == *" $rc "* ]]; then
    echo "cuda-link-check: $name: exit $rc (ok): $(tail -1 "/tmp/cuda-link-check.$$.log")"
  else
    echo "cuda-link-check: $name: exit $rc, expected one of: $expected" >&2
    tail -20 "/tmp/cuda-link-check.$$.log" >&2
    failures=$((failures + 1))
  fi
}
gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
run gpu_host "0" "$build_dir/tests/gpu/test_gpu_host" --no-colors
if [ $gpu -eq 0 ]; then
  run gpu_device "77" "$build_dir/tests/gpu/test_gpu_device" --no-colors --test-suite-exclude=torch_cuda
  run gpu_device_torch "77" "$build_dir/tests/gpu/test_gpu_device" --no-colors --test-suite=torch_cuda
fi
run bench_gpu "0 1 77" "$build_dir/bench/bench_gpu" --benchmark_min_time=0.01
if [ $has_gloo -eq 1 ]; then
  run "bench_reduce --cuda" "0 1 77" "$build_dir/bench/bench_reduce" --cuda --benchmark_min_time=0.01
  run "bench_ops --cuda" "0 77" "$build_dir/bench/bench_ops" --cuda --params=160
fi
for e in finetune_icons generators_to_devices fashion_mnist_multiscale; do
  run "$e --help" "0" "$build_dir/examples/$e" --help
done
rm -f "/tmp/cuda-link-check.$$.log"
if [ $failures -ne 0 ]; then
  stamp "FAILED: $failures check(s)"
  exit 1
fi
stamp "OK"

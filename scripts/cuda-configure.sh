#!/usr/bin/env bash
# Configures a Meson build of loom against the CUDA build of torch that PYTHON imports: the one
# configuration path of scripts/cuda-link-check.sh (here, CPU only) and scripts/device-check.sh (on a
# GPU machine), so that what the first proves is what the second runs.
#
# LibTorch: PYTHON's torch folder (-Dtorch_dir) and its C++ ABI (torch._C._GLIBCXX_USE_CXX11_ABI).
# CUDA runtime and NCCL: Meson's defaults, i.e. the nvidia/cu13 (or cu12) and nvidia/nccl folders that
# pip installs beside torch (the very libraries LibTorch loads), else /usr/local/cuda. Gloo: auto (its
# headers come from the system when present; a machine without them builds the NCCL path only).
# Fails unless LibTorch has CUDA (LOOM_TORCH_HAS_CUDA really on), CUDA and NCCL are found.
#
# Usage: scripts/cuda-configure.sh BUILD_DIR PYTHON [MESON_ARGS...]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR PYTHON [MESON_ARGS...]" >&2
  exit 2
fi
build_dir=$1
python=$2
shift 2
cd "$(dirname "$0")/.."
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) ||
  { echo "cuda-configure: $python cannot import torch" >&2; exit 1; }
abi=$("$python" -c 'import torch; print(str(torch._C._GLIBCXX_USE_CXX11_ABI).lower())' 2>/dev/null)
cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)
if [ -z "$cuda" ]; then
  echo "cuda-configure: $python's torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null) is not a CUDA build" >&2
  exit 1
fi
reconf=()
if [ -f "$build_dir/build.ninja" ]; then reconf=(--reconfigure); fi
meson setup "${reconf[@]}" "$build_dir" --wrap-mode=nodownload -Dtorch_dir="$torch_dir" -Dtorch_cxx11_abi="$abi" \
  -Dcuda=enabled -Dnccl=enabled "$@"
config=$build_dir/include/loom/build_config.hpp
for flag in LOOM_TORCH_HAS_CUDA LOOM_HAS_CUDA LOOM_HAS_NCCL; do
  if ! grep -q "#define $flag 1" "$config"; then
    echo "cuda-configure: $flag is not 1 in $config" >&2
    exit 1
  fi
done
echo "cuda-configure: $build_dir/ against torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null) (CUDA $cuda) in $torch_dir"

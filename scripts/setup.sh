#!/usr/bin/env bash
# Installs every Debian package loom's build, tests, benchmarks and examples need, points the
# system BLAS at OpenBLAS, installs pip's CPU torch 2.13 into .venv/ (a LibTorch 2.x), and
# configures two Meson build directories, one per LibTorch:
#   BUILD_DIR (default build/)             Debian's libtorch-dev (1.13 on Debian 12) and libgloo-dev
#   TORCH2_BUILD_DIR (default build-torch2/) the LibTorch inside .venv's torch 2.13.0 (CPU; c10d and
#                                          Gloo compiled into its libtorch_cpu)
# Idempotent: re-running it installs nothing new and reconfigures only when needed.
#
# Usage: scripts/setup.sh [BUILD_DIR [TORCH2_BUILD_DIR]]   (run as root, or with sudo available)
# LOOM_SETUP_TORCH2=0 skips the .venv and the second build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}
torch2_build_dir=${2:-build-torch2}

packages=(
  # build tools
  g++ meson ninja-build pkg-config cmake ccache git
  # LibTorch 1.13 (CPU, with c10d) and Gloo headers for ProcessGroupGloo
  libtorch-dev libgloo-dev
  # OpenBLAS: Debian's LibTorch uses the reference BLAS otherwise (~10x slower matmul)
  libopenblas0-pthread
  # header libraries
  librange-v3-dev libfmt-dev doctest-dev libbenchmark-dev libcli11-dev
  # Open MPI, for the test under a real mpirun
  openmpi-bin libopenmpi-dev
  # image decoding and real data for the examples and tests
  libpng-dev libstb-dev adwaita-icon-theme dataset-fashion-mnist
  # valgrind for the composition-overhead script (callgrind); gnuplot for the benchmark figures
  # (scripts/plot_benchmarks.sh); clang-format for the format check of the tests
  valgrind gnuplot-nox clang-format
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The time series of the generators example come from python3-vega-datasets; its CSVs are
# unpacked alone (the package would pull in pandas).
vega_dir=/usr/lib/python3/dist-packages/vega_datasets/_data
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
if [ ! -f "$vega_dir/us-employment.csv" ] && [ ! -f third_party_data/vega_datasets/us-employment.csv ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download python3-vega-datasets >/dev/null 2>&1 || { "${sudo_cmd[@]}" apt-get update -q && apt-get download python3-vega-datasets; })
  mkdir -p third_party_data
  dpkg -x "$tmp"/python3-vega-datasets_*.deb "$tmp/x"
  rm -rf third_party_data/vega_datasets
  cp -r "$tmp/x$vega_dir" third_party_data/vega_datasets
  rm -rf "$tmp"
fi

# Point libblas.so.3 / liblapack.so.3 at OpenBLAS for every program (Debian's alternatives).
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
for lib in libblas.so.3 liblapack.so.3; do
  target=/usr/lib/$arch/openblas-pthread/$lib
  if [ -e "$target" ]; then
    "${sudo_cmd[@]}" update-alternatives --set "$lib-$arch" "$target" >/dev/null 2>&1 || true
  fi
done

export CCACHE_DIR=${CCACHE_DIR:-$HOME/.ccache}
if [ ! -f "$build_dir/build.ninja" ]; then
  CXX="ccache g++" meson setup "$build_dir" --wrap-mode=nodownload
fi
echo "setup: $build_dir/ uses Debian's LibTorch $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo '?')"

# LibTorch 2.x: pip's CPU wheel of torch 2.13.0 in a virtual environment of the checkout (.venv/,
# ignored by git); the wheel holds a complete LibTorch (include/, lib/, share/cmake/).
if [ "${LOOM_SETUP_TORCH2:-1}" != 0 ]; then
  torch_version=2.13.0
  venv=.venv
  if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    python3 -m venv --help >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q python3-venv
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "torch==$torch_version"
  fi
  # The format check's clang-format, the same 14.0.6 on Debian 12 and 13 (Debian 13 ships 19).
  "$venv/bin/clang-format" --version 2>/dev/null | grep -q "version 14.0.6" || "$venv/bin/pip" install -q clang-format==14.0.6
  torch_dir=$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) ||
    { echo "setup: $venv/bin/python cannot import torch" >&2; exit 1; }
  abi=$("$venv/bin/python" -c 'import torch; print(str(torch._C._GLIBCXX_USE_CXX11_ABI).lower())' 2>/dev/null)
  # A CPU torch finds no CUDA by itself (-Dcuda=auto); with a toolkit on the machine the CPU build
  # still compiles loom/cuda's headers (packaging_headers) when asked to: -Dcuda=enabled.
  cuda_opt=-Dcuda=auto
  if [ -f /usr/local/cuda/include/cuda_runtime_api.h ] && [ -f /usr/local/cuda/include/crt/host_defines.h ] &&
     compgen -G '/usr/local/cuda/lib*/libcudart.so*' >/dev/null; then
    cuda_opt=-Dcuda=enabled
  fi
  if [ ! -f "$torch2_build_dir/build.ninja" ]; then
    CXX="ccache g++" meson setup "$torch2_build_dir" --wrap-mode=nodownload -Dtorch_dir="$torch_dir" -Dtorch_cxx11_abi="$abi" \
      "$cuda_opt"
  fi
  echo "setup: $torch2_build_dir/ uses pip's torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) ($torch_dir)"
fi

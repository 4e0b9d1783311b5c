#!/usr/bin/env bash
# Installs every Debian package loom's build, tests, benchmarks and examples need, points the
# system BLAS at OpenBLAS, and configures the Meson build directory (default: build/).
# Idempotent: re-running it installs nothing new and reconfigures only when needed.
#
# Usage: scripts/setup.sh [BUILD_DIR]      (run as root, or with sudo available)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${1:-build}

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

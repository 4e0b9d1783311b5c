#!/usr/bin/env bash
# Prepares what scripts/device-check.sh needs on the GPU machine but that machine's image may
# lack: the Debian packages of loom's C++ dependencies ({fmt}, range-v3, doctest, Google
# Benchmark, libpng, zlib, CLI11; Gloo's headers, which ProcessGroupGloo.hpp needs and pip's torch does
# not ship; adwaita-icon-theme, the icons finetune_icons trains on), downloaded here with `apt-get download` (nothing installed)
# into .device-deps/, which git ignores (.git/info/exclude) and the device run carries.
#
# Usage (on this Debian 12 machine, once):   bash scripts/device-deps.sh
# Then the device run:  command "bash scripts/device-check.sh $OUT", carry [".device-deps"].
# device-check.sh unpacks them with dpkg -x into /tmp (never into /) and points the compiler,
# pkg-config and CMake at them; it works without them where the image already has the libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.device-deps
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" "$dest"
grep -qx "/$dest/" "$exclude" 2>/dev/null || echo "/$dest/" >> "$exclude"

packages=(libfmt-dev libfmt9 librange-v3-dev doctest-dev libbenchmark-dev libbenchmark1debian
          libpng-dev libpng16-16 zlib1g-dev zlib1g libcli11-dev libgloo-dev adwaita-icon-theme)
cd "$dest"
rm -f ./*.deb
if ! apt-get download "${packages[@]}"; then
  echo "device-deps: apt-get download failed; trying again after apt-get update" >&2
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  apt-get download "${packages[@]}"
fi
ls -l ./*.deb
du -sh .

#!/usr/bin/env bash
# Checks that a build without CUDA / NCCL gets one clear #error from loom's GPU headers, not a
# wall of template noise: each header is compiled against a fake <loom/build_config.hpp> saying
# the backend is missing, and the first (fatal) error must be loom's own message.
# Usage: check_header_guards.sh INCLUDE_DIR COMPILER [COMPILER ARGS...]
set -euo pipefail
include_dir=$1
shift
compiler=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

# expect_error HAS_CUDA HAS_NCCL HEADER TEXT
expect_error() {
  local c=$1 n=$2 h=$3 t=$4
  mkdir -p "$tmp/cfg$c$n/loom"
  printf '#pragma once\n#define LOOM_HAS_GLOO 0\n#define LOOM_HAS_CUDA %s\n#define LOOM_HAS_NCCL %s\n#define LOOM_TORCH_HAS_CUDA 0\n' \
    "$c" "$n" > "$tmp/cfg$c$n/loom/build_config.hpp"
  printf '#include <%s>\n' "$h" > "$tmp/tu.cpp"
  if "${compiler[@]}" -std=c++20 -fsyntax-only -Wfatal-errors -I"$tmp/cfg$c$n" -I"$include_dir" "$tmp/tu.cpp" >"$tmp/out" 2>&1; then
    echo "FAIL: <$h> compiled although LOOM_HAS_CUDA=$c LOOM_HAS_NCCL=$n"
    failures=$((failures + 1))
  elif grep -q -- "$t" "$tmp/out"; then
    echo "ok: <$h> with LOOM_HAS_CUDA=$c LOOM_HAS_NCCL=$n: $(grep -m1 -o '#error.\{0,90\}' "$tmp/out")..."
  else
    echo "FAIL: <$h> with LOOM_HAS_CUDA=$c LOOM_HAS_NCCL=$n did not report '$t'; the compiler said:"
    head -5 "$tmp/out"
    failures=$((failures + 1))
  fi
}

expect_error 0 0 loom/comm/nccl.hpp "LOOM_HAS_NCCL=0"
expect_error 1 0 loom/comm/nccl.hpp "LOOM_HAS_NCCL=0"
for h in error device stream buffer pinned transfer all; do
  expect_error 0 0 "loom/cuda/$h.hpp" "LOOM_HAS_CUDA=0"
done
[ "$failures" -eq 0 ] || { echo "$failures header guard check(s) failed"; exit 1; }

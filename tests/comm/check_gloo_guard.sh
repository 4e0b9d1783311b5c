#!/usr/bin/env bash
# Compile-fail check: including <loom/comm/gloo.hpp> in a build without Gloo (LOOM_HAS_GLOO=0) must
# stop with loom's one clear #error, and nothing else (no wall of template noise after it).
# Usage: check_gloo_guard.sh INCLUDE_DIR COMPILER [COMPILER ARGS...]
set -euo pipefail
include_dir=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/loom"
printf '#pragma once\n#define LOOM_HAS_GLOO 0\n#define LOOM_HAS_CUDA 0\n#define LOOM_HAS_NCCL 0\n' > "$tmp/loom/build_config.hpp"
printf '#include <loom/comm/gloo.hpp>\nint main() { return 0; }\n' > "$tmp/tu.cpp"
if "$@" -std=c++20 -fsyntax-only -I"$tmp" -I"$include_dir" "$tmp/tu.cpp" >"$tmp/out" 2>&1; then
  echo "FAIL: <loom/comm/gloo.hpp> compiled with LOOM_HAS_GLOO=0"
  exit 1
fi
errors=$(grep -c 'error:' "$tmp/out" || true)
if grep -q 'LOOM_HAS_GLOO=0: install libgloo-dev' "$tmp/out" && [ "$errors" -eq 1 ]; then
  echo "ok: $(grep -m1 -o '#error.\{0,100\}' "$tmp/out")..."
  exit 0
fi
echo "FAIL: expected exactly one error, loom's; the compiler said ($errors errors):"
head -20 "$tmp/out"
exit 1

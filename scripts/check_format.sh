#!/usr/bin/env bash
# Checks that every C++ file in git follows the project's .clang-format with clang-format 14.0.6:
# pip's clang-format==14.0.6 in .venv/ (scripts/setup.sh installs it, so Debian 13's clang-format 19
# does not reformat the tree), else the system's clang-format 14.
# Usage: scripts/check_format.sh         -> lists the files that differ, exit 1 if any
#        scripts/check_format.sh --fix   -> formats them in place
# Run by scripts/test.sh (and so by CI) before the build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/clang-format ]; then
  clang_format=.venv/bin/clang-format
else
  clang_format=clang-format
fi
command -v "$clang_format" >/dev/null || { echo "check_format: clang-format is not installed (scripts/setup.sh)" >&2; exit 1; }
case "$("$clang_format" --version)" in
  *"version 14."*) ;;
  *) echo "check_format: $("$clang_format" --version) is not clang-format 14 (scripts/setup.sh installs 14.0.6 into .venv/)" >&2; exit 1 ;;
esac
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.h' '*.cu' | grep -v '^subprojects/')
if [ "${1:-}" = "--fix" ]; then
  "$clang_format" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$clang_format" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check_format: ${#bad[@]} file(s) differ from .clang-format ($("$clang_format" --version)):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "fix with: scripts/check_format.sh --fix" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files follow .clang-format"

#!/usr/bin/env bash
# Checks that every C++ file in git follows the project's .clang-format (clang-format 14, Debian 12).
# Usage: scripts/check_format.sh         -> lists the files that differ, exit 1 if any
#        scripts/check_format.sh --fix   -> formats them in place
# Run by scripts/test.sh (and so by CI) before the build.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "check_format: clang-format is not installed (apt-get install clang-format)" >&2; exit 1; }
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.h' '*.cu' | grep -v '^subprojects/')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check_format: ${#bad[@]} file(s) differ from .clang-format ($(clang-format --version)):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "fix with: scripts/check_format.sh --fix" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files follow .clang-format"

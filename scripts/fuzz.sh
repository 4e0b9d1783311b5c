#!/usr/bin/env bash
# libFuzzer run over everything loom reads from text a user hands in (tests/fuzz/fuzz_state_text.cpp:
# checkpoint state lines and the launcher's environment).
#
# Usage: bash scripts/fuzz.sh [SECONDS]        (default 300; run as root, or with sudo available)
# 1. Installs Debian's clang when it is missing (Debian 12: clang 14, whose libclang-common-14-dev
#    carries libFuzzer; Debian 13: clang 19 and libclang-rt-19-dev).
# 2. Builds build-fuzz/fuzz_state_text with clang++ -fsanitize=fuzzer,address,undefined against the
#    LibTorch headers of .venv's pip torch (made by scripts/setup.sh; the target links none of
#    LibTorch's code, it only includes headers that include ATen).
# 3. Runs it for SECONDS with the seeds of tests/fuzz/seeds/ (valid lines of every kind), keeping
#    the corpus it grows in build-fuzz/corpus/ and any crashing input in build-fuzz/findings/.
# Exit code: 0 when no input broke the contract; libFuzzer's (non-zero) otherwise. A finding is a
# file in build-fuzz/findings/: replay it with `build-fuzz/fuzz_state_text FILE`, then make it a
# case of tests/sample/test_state_text.cpp before fixing it.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-300}
out=build-fuzz
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)

probe() {  # whether clang++ links a libFuzzer program
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$out/probe.cpp"
  clang++ -fsanitize=fuzzer "$out/probe.cpp" -o "$out/probe" >/dev/null 2>&1
}
mkdir -p "$out/corpus" "$out/findings"
if ! command -v clang++ >/dev/null || ! probe; then
  echo "fuzz: installing clang (and its libFuzzer runtime)"
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends clang
  if ! probe; then  # Debian 13 ships the runtime apart
    version=$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p')
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "libclang-rt-$version-dev"
    probe
  fi
fi

# LibTorch headers: pip's torch in .venv (scripts/setup.sh); Debian's 1.13 headers do not compile
# with clang in C++20 (ivalue_inl.h assigns through a const reference).
torch_include=$(ls -d .venv/lib/python3*/site-packages/torch/include 2>/dev/null | head -1 || true)
if [ -z "$torch_include" ]; then
  echo "fuzz: no .venv/lib/python3*/site-packages/torch/include; run scripts/setup.sh first" >&2
  exit 2
fi
start=$(date +%s)
echo "fuzz: building $out/fuzz_state_text ($(clang++ --version | head -1); headers of $torch_include)"
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -DFMT_HEADER_ONLY=1 -Iinclude -isystem "$torch_include" -isystem "$torch_include/torch/csrc/api/include" \
  tests/fuzz/fuzz_state_text.cpp -o "$out/fuzz_state_text"
echo "fuzz: built in $(($(date +%s) - start)) s; running for $seconds s"
rc=0
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0} "$out/fuzz_state_text" -max_total_time="$seconds" -max_len=512 \
  -artifact_prefix="$out/findings/" -print_final_stats=1 "$out/corpus" tests/fuzz/seeds || rc=$?
echo "fuzz: exit code $rc; corpus $(ls "$out/corpus" | wc -l) inputs; findings: $(ls "$out/findings" | wc -l)"
exit "$rc"

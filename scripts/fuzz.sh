#!/usr/bin/env bash
# libFuzzer runs over everything loom reads from what a user hands in: tests/fuzz/fuzz_state_text.cpp
# (checkpoint state lines, the launcher's environment) and tests/fuzz/fuzz_data_files.cpp (the
# examples' dataset readers: IDX, PNG, CSV files).
#
# Usage: bash scripts/fuzz.sh [SECONDS]        (per target; default 300; as root, or with sudo available)
# 1. Installs Debian's clang when it is missing (Debian 12: clang 14, whose libclang-common-14-dev
#    carries libFuzzer; Debian 13: clang 19 and libclang-rt-19-dev).
# 2. Builds build-fuzz/fuzz_state_text and build-fuzz/fuzz_data_files with clang++
#    -fsanitize=fuzzer,address,undefined against .venv's pip torch (made by scripts/setup.sh; the
#    data target links its libtorch_cpu, libpng and zlib).
# 3. Runs each for SECONDS with its seeds (tests/fuzz/seeds/: valid lines of every kind;
#    tests/fuzz/seeds-data/: a small IDX, gzip'd IDX, PNG and CSV), keeping the corpus it grows in
#    build-fuzz/corpus/<target>/ and any crashing input in build-fuzz/findings/<target>-*; an
#    input that makes a reader allocate over 1 GiB at once (-malloc_limit_mb) or hold 2 GiB is a
#    finding too.
# Exit code: 0 when no input broke the contract; libFuzzer's (non-zero) otherwise. A finding is a
# file in build-fuzz/findings/: replay it with `build-fuzz/<target> FILE`, then make it a failing
# case (tests/sample/test_state_text.cpp, tests/examples/test_data.cpp) before fixing it.
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
mkdir -p "$out/findings"
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
torch_lib=$torch_include/../lib
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -DFMT_HEADER_ONLY=1
       -Iinclude -Iexamples -isystem "$torch_include" -isystem "$torch_include/torch/csrc/api/include")
start=$(date +%s)
echo "fuzz: building $out/fuzz_state_text and $out/fuzz_data_files ($(clang++ --version | head -1); headers of $torch_include)"
clang++ "${flags[@]}" tests/fuzz/fuzz_state_text.cpp -o "$out/fuzz_state_text"
clang++ "${flags[@]}" tests/fuzz/fuzz_data_files.cpp -o "$out/fuzz_data_files" \
  -L"$torch_lib" -Wl,-rpath,"$(cd "$torch_lib" && pwd)" -ltorch_cpu -lc10 -lpng -lz
echo "fuzz: built in $(($(date +%s) - start)) s; running each target for $seconds s"
rc=0
for target in fuzz_state_text:tests/fuzz/seeds fuzz_data_files:tests/fuzz/seeds-data; do
  name=${target%%:*}
  mkdir -p "$out/corpus/$name"
  # -rss_limit_mb: a reader that allocates what a short file's header claims is a finding.
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1} OMP_NUM_THREADS=1 \
    "$out/$name" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
    -artifact_prefix="$out/findings/$name-" -print_final_stats=1 "$out/corpus/$name" "${target#*:}" || rc=$?
  echo "fuzz: $name: exit code $rc; corpus $(ls "$out/corpus/$name" | wc -l) inputs"
done
echo "fuzz: findings: $(ls "$out/findings" | wc -l) (in $out/findings/)"
exit "$rc"

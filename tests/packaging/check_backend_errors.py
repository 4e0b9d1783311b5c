#!/usr/bin/env python3
"""Compile-fail test: a backend header included in a build without its backend stops at loom's own
#error, as the first diagnostic, not at a wall of template noise from the backend's headers.

Each case compiles a one-line TU against a fake <loom/build_config.hpp> placed before the real
include directory (so LOOM_HAS_* are forced whatever this build found), with -Wfatal-errors, and
checks that compilation fails and that the first error line carries the expected text.

Usage: check_backend_errors.py INCLUDE_DIR -- COMPILER [ARGS...]
"""
import os
import re
import subprocess
import sys
import tempfile

# (header, LOOM_HAS_GLOO, LOOM_HAS_CUDA, LOOM_HAS_NCCL, extra flags, expected text of the first error)
CASES = [
    ("loom/comm/gloo.hpp", 0, 0, 0, ["-DUSE_DISTRIBUTED", "-DUSE_C10D_GLOO"],
     "loom/comm/gloo.hpp needs Gloo, but this build has LOOM_HAS_GLOO=0"),
    ("loom/comm/gloo.hpp", 1, 0, 0, [],  # Gloo there, but c10d's Gloo headers would compile to nothing
     "loom/comm/gloo.hpp needs -DUSE_C10D_GLOO"),
    ("loom/comm/nccl.hpp", 0, 0, 0, [],
     "loom/comm/nccl.hpp needs NCCL and the CUDA runtime, but this build has LOOM_HAS_NCCL=0"),
    ("loom/comm/nccl.hpp", 0, 1, 0, [],  # CUDA without NCCL
     "loom/comm/nccl.hpp needs NCCL and the CUDA runtime, but this build has LOOM_HAS_NCCL=0"),
]


def main():
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") != 1:
        print(__doc__)
        return 2
    include_dir, compiler = argv[0], argv[2:]
    failures = 0
    with tempfile.TemporaryDirectory(prefix="loom-backend-errors-") as tmp:
        for i, (header, gloo, cuda, nccl, flags, expected) in enumerate(CASES):
            fake = os.path.join(tmp, f"cfg{i}")
            os.makedirs(os.path.join(fake, "loom"))
            with open(os.path.join(fake, "loom", "build_config.hpp"), "w") as f:
                f.write("#pragma once\n"
                        f"#define LOOM_HAS_GLOO {gloo}\n#define LOOM_HAS_CUDA {cuda}\n"
                        f"#define LOOM_HAS_NCCL {nccl}\n#define LOOM_TORCH_HAS_CUDA 0\n")
            tu = os.path.join(tmp, f"tu{i}.cpp")
            with open(tu, "w") as f:
                f.write(f"#include <{header}>\nint main() {{ return 0; }}\n")
            cmd = compiler + ["-std=c++20", "-fsyntax-only", "-Wfatal-errors", "-I" + fake, "-I" + include_dir] + flags + [tu]
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            errors = [l for l in p.stdout.splitlines() if re.search(r": (fatal )?error: ", l)]
            what = f"<{header}> with GLOO={gloo} CUDA={cuda} NCCL={nccl} {' '.join(flags)}".rstrip()
            if p.returncode == 0:
                print(f"FAIL: {what} compiled; expected #error '{expected}'")
                failures += 1
            elif not errors or "#error" not in errors[0] or expected not in errors[0]:
                print(f"FAIL: {what}: the first error is not loom's '{expected}'; the compiler said:")
                print("\n".join(p.stdout.splitlines()[:8]))
                failures += 1
            else:
                print(f"ok: {what}: {errors[0][errors[0].index('#error'):][:110]}...")
    if failures:
        print(f"{failures} of {len(CASES)} backend-header check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

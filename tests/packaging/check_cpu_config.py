#!/usr/bin/env python3
"""A CPU LibTorch's build links no CUDA runtime and no NCCL by default, even with a CUDA toolkit on
the machine: configures a scratch build of this source tree against the same LibTorch with
-Dcuda=auto -Dnccl=auto (no tests, benchmarks or examples), then checks its build_config.hpp
(LOOM_HAS_CUDA 0, LOOM_HAS_NCCL 0) and the package files it would install, loom.pc and
loomConfig.cmake (no cudart, no nccl, no CUDA include folder). Skipped (exit 77) when the LibTorch
has CUDA.

Usage: check_cpu_config.py --meson MESON --source DIR --workdir DIR [--torch-dir DIR]
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meson", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--torch-dir", default="")
    a = ap.parse_args()
    work = pathlib.Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    cmd = [a.meson, "setup", str(work), a.source, "--wrap-mode=nodownload", "-Dcuda=auto", "-Dnccl=auto",
           "-Dtests=false", "-Dbenchmarks=false", "-Dexamples=false"]
    if a.torch_dir:
        cmd.append(f"-Dtorch_dir={a.torch_dir}")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        print(p.stdout[-8000:])
        print("FAIL: meson setup of the scratch CPU build failed")
        return 1
    config = (work / "include" / "loom" / "build_config.hpp").read_text()

    def flag(name):
        m = re.search(rf"#define {name} (\d)", config)
        return int(m.group(1)) if m else None

    if flag("LOOM_TORCH_HAS_CUDA") == 1:
        print("skip: this LibTorch has CUDA")
        return 77
    failures = []
    for name in ("LOOM_HAS_CUDA", "LOOM_HAS_NCCL"):
        if flag(name) != 0:
            failures.append(f"build_config.hpp: {name} = {flag(name)}, want 0 for a CPU LibTorch")
    packaged = [f for f in work.rglob("*") if f.name in ("loom.pc", "loomConfig.cmake")]
    if len(packaged) != 2:
        failures.append(f"want loom.pc and loomConfig.cmake in the scratch build, found {[str(f) for f in packaged]}")
    for f in packaged:
        text = f.read_text()
        for bad in ("cudart", "nccl", "/cuda/include", "/usr/local/cuda"):
            for line in text.splitlines():
                if bad in line.lower() and not line.lstrip().startswith("#") and "loom_has_" not in line.lower():
                    failures.append(f"{f.name}: '{bad}' in: {line.strip()[:200]}")
    for line in failures:
        print("FAIL", line)
    if not failures:
        print(f"ok: LOOM_HAS_CUDA 0, LOOM_HAS_NCCL 0; {', '.join(f.name for f in packaged)} link no CUDA runtime or NCCL")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

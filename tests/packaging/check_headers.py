#!/usr/bin/env python3
"""Builds the header self-containment library (one TU per loom header) and the ODR program (two
TUs with every header, linked together) with ninja, then runs the ODR program.

Building them here, inside a test, keeps a broken header a failed test (with the compiler's message
naming the header's TU, header_loom_<path>.cpp) instead of aborting the whole `meson test` run.

Usage: check_headers.py --ninja NINJA --builddir DIR --target T [--target T...] --run PROGRAM --count N
"""
import argparse
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ninja", required=True)
    ap.add_argument("--builddir", required=True)
    ap.add_argument("--target", action="append", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--count", type=int, required=True)
    a = ap.parse_args()

    print(f"compiling {a.count} header TUs and the ODR program ...", flush=True)
    # -k 0: report every broken header, not only the first.
    p = subprocess.run([a.ninja, "-C", a.builddir, "-k", "0"] + a.target, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    failed = [l for l in p.stdout.splitlines() if l.startswith("FAILED:")]
    print(p.stdout[-20000:], flush=True)
    if p.returncode != 0:
        print(f"FAIL: {len(failed)} target(s) did not build:")
        for l in failed:
            print("  ", l)
        return 1
    r = subprocess.run([a.run], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(r.stdout, end="")
    if r.returncode != 0:
        print(f"FAIL: the ODR program exited with {r.returncode}")
        return 1
    print(f"ok: {a.count} headers compile on their own; the ODR program links and runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

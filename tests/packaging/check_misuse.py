#!/usr/bin/env python3
"""Compile-fail test: misuse that loom turns into one static_assert. Each case is a target (one TU,
tests/packaging/misuse/) that must fail to build with exactly one error, whose text is loom's.

Usage: check_misuse.py --ninja NINJA --builddir DIR --case TARGET EXPECTED_TEXT [--case ...]
"""
import argparse
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ninja", required=True)
    ap.add_argument("--builddir", required=True)
    ap.add_argument("--case", nargs=2, action="append", required=True, metavar=("TARGET", "EXPECTED"))
    a = ap.parse_args()
    failures = 0
    for target, expected in a.case:
        p = subprocess.run([a.ninja, "-C", a.builddir, target], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        errors = [l for l in p.stdout.splitlines() if " error: " in l or l.startswith("error: ")]
        if p.returncode == 0:
            print(f"FAIL {target}: it compiled; the misuse must not")
            failures += 1
        elif len(errors) != 1 or expected not in errors[0]:
            print(f"FAIL {target}: want exactly one error containing\n  {expected}\ngot {len(errors)}:")
            for l in errors[:10]:
                print("  ", l[:400])
            failures += 1
        else:
            print(f"ok {target}: {errors[0][errors[0].index(' error: ') + 1:][:300]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Compile-fail test: misuse that loom turns into one static_assert. Each case is a target (one TU,
tests/packaging/misuse/) that must fail to build with exactly one error, whose text is loom's.

Usage: check_misuse.py --ninja NINJA --builddir DIR --case TARGET EXPECTED_TEXT [--case ...]
"""
import argparse
import os
import re
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ninja", required=True)
    ap.add_argument("--builddir", required=True)
    ap.add_argument("--case", nargs=2, action="append", required=True, metavar=("TARGET", "EXPECTED"))
    a = ap.parse_args()
    # One ninja call for every case, two compiles at a time; -k 0: every case is built whatever the
    # others do. Ninja prints each failed edge as "FAILED: ... <object>" followed by the compiler's
    # output, up to the next status line ("[i/n] ...") or its closing "ninja: ..." line.
    p = subprocess.run([a.ninja, "-C", a.builddir, "-k", "0", "-j", "2"] + [t for t, _ in a.case],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    blocks = []  # (FAILED line, the lines after it)
    out = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout)  # CLICOLOR_FORCE=1 colours "FAILED:"
    for line in out.splitlines():
        if line.startswith("FAILED:"):
            blocks.append((line, []))
        elif re.match(r"\[\d+/\d+\] ", line) or line.startswith("ninja: "):
            blocks.append(None)
        elif blocks and blocks[-1] is not None:
            blocks[-1][1].append(line)
    failed = [b for b in blocks if b is not None]
    failures = 0
    for target, expected in a.case:
        # The case's object lies in the target's private folder, e.g. libmisuse_x.a.p/.
        mine = [lines for head, lines in failed if (target.rsplit("/", 1)[-1] + ".p/") in head]
        errors = [l for lines in mine for l in lines if " error: " in l or l.startswith("error: ")]
        if not mine and os.path.exists(os.path.join(a.builddir, target)):
            print(f"FAIL {target}: it compiled; the misuse must not")
            failures += 1
        elif not mine:
            print(f"FAIL {target}: not built (ninja stopped before it):\n{out[-3000:]}")
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

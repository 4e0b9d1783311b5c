#!/usr/bin/env python3
"""Checks that a program built with loom's Gloo communicator uses Gloo only through c10d.

loom compiles c10d's ProcessGroupGloo.hpp against whatever Gloo headers the build has (LibTorch's own
when it ships them; else the system's libgloo-dev, which need not be the Gloo inside libtorch_cpu).
That is safe only while no Gloo type's layout, virtual function or inline code ends up in loom's
code: the program may name Gloo types inside template arguments (a std::shared_ptr<gloo::...>),
but it must neither reference nor define any symbol of Gloo's own (gloo::..., its vtables and
typeinfo). This script lists the program's symbols with nm and fails naming each such symbol.

Usage: check_gloo_symbols.py NM PROGRAM [PROGRAM...]
"""
import re
import subprocess
import sys

# A symbol of Gloo's own: its demangled name starts with gloo:: (after an optional "vtable for " and
# the like), as opposed to a template of another namespace with gloo types among its arguments.
OWN = re.compile(r"^(?:(?:vtable|typeinfo|typeinfo name|VTT|construction vtable) for |(?:non-)?virtual thunk to )*"
                 r"gloo::")


def main() -> int:
    nm, programs = sys.argv[1], sys.argv[2:]
    bad = []
    total = 0
    for program in programs:
        out = subprocess.run([nm, "-C", program], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) == 3:
                _, kind, name = parts
            elif len(parts) == 2:
                kind, name = parts
            else:
                continue
            if "gloo" in name:
                total += 1
            if OWN.match(name):
                bad.append(f"{program}: {kind} {name}")
    if bad:
        print("loom code uses Gloo's own symbols (its layout or code, not only c10d's functions):")
        print("\n".join(bad))
        return 1
    print(f"OK: {len(programs)} program(s), {total} symbol(s) mention gloo, none of them Gloo's own")
    return 0


if __name__ == "__main__":
    sys.exit(main())

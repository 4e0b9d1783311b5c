#!/usr/bin/env python3
"""Prints loom's headers (paths relative to INCLUDE_DIR, e.g. loom/comm/local.hpp), one per line,
sorted. Used by tests/packaging/meson.build at configure time to generate one TU per header."""
import os
import sys

root = sys.argv[1]
out = []
for d, _, files in os.walk(os.path.join(root, "loom")):
    for f in files:
        if f.endswith(".hpp"):
            out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
print("\n".join(sorted(out)))

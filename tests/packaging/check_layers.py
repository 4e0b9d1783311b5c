#!/usr/bin/env python3
"""Checks the layering of include/loom against docs/design.md's "Layers" list: a header may include
loom headers of its own folder and of folders in lower layers only (layer 0, the top-level headers
and loom/detail/, is one base), and every folder is in the list.

The list is read from the design document itself (lines "- layer N: `loom/a/`, `loom/b/` ..."), so
the picture and the code cannot drift apart. `loom/*.hpp` stands for the top-level headers;
`loom/loom.hpp`, the umbrella, may include anything.

Usage: check_layers.py SOURCE_ROOT
"""
import os
import re
import sys


def read_layers(design):
    # An item may go on over indented lines: join them first.
    items = []
    for line in open(design, encoding="utf-8"):
        if line.startswith("- "):
            items.append(line.strip())
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
        else:
            items.append("")
    layers = {}
    for item in items:
        m = re.match(r"- layer (\d+): (.*)", item)
        if not m:
            continue
        for token in re.findall(r"`loom/([^`]*)`", m.group(2)):
            name = "(top)" if token == "*.hpp" else token.rstrip("/")
            layers[name] = int(m.group(1))
    return layers


def folder_of(path):
    parts = path.split("/")
    return parts[0] if len(parts) > 1 else "(top)"


def main():
    root = sys.argv[1]
    include = os.path.join(root, "include", "loom")
    layers = read_layers(os.path.join(root, "docs", "design.md"))
    if not layers:
        print("FAIL: docs/design.md has no '- layer N: `loom/...`' lines")
        return 1
    problems = []
    folders = {d for d in os.listdir(include) if os.path.isdir(os.path.join(include, d))} | {"(top)"}
    for f in sorted(folders - set(layers)):
        problems.append(f"include/loom/{f}/ is in no layer of docs/design.md")
    for f in sorted(set(layers) - folders):
        problems.append(f"docs/design.md names loom/{f}/, which does not exist")
    checked = 0
    for dirpath, _, files in os.walk(include):
        for name in sorted(files):
            if not name.endswith(".hpp"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), include)
            if rel == "loom.hpp":
                continue
            src = folder_of(rel)
            checked += 1
            for n, line in enumerate(open(os.path.join(dirpath, name), encoding="utf-8"), 1):
                m = re.match(r"\s*#\s*include\s*<loom/([^>]+)>", line)
                if not m or m.group(1) == "build_config.hpp":
                    continue
                dst = folder_of(m.group(1))
                if dst == src or src not in layers or dst not in layers:
                    continue
                # Layer 0 is one base: its top-level headers and detail/ may include each other.
                if layers[dst] >= layers[src] and not (layers[dst] == layers[src] == 0):
                    problems.append(f"include/loom/{rel}:{n} includes <loom/{m.group(1)}>: loom/{dst}/ is layer "
                                    f"{layers[dst]}, not below loom/{src}/ (layer {layers[src]})")
    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    print(f"ok: {checked} headers in {len(folders)} folders follow docs/design.md's layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())

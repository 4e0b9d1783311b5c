#!/usr/bin/env python3
"""Checks the rules the docs state about the tree against the tree itself:

1. docs/style.md's "No header over N lines": every header under include/loom has at most N lines
   (N is read from the sentence, so the rule and the check cannot drift apart).
2. docs/design.md names files as `loom/<folder>/<file>.hpp`: each one exists (a file moved or
   removed without the design page following fails here).
3. docs/design.md's "Where to look" table names a file for each of the questions it lists, and
   each named file exists.
4. docs/style.md's "Tests mirror `include/loom/`": every folder of include/loom has tests/<folder>/
   with a test file (loom/cuda/'s in tests/gpu/, as the rule says).

Usage: check_doc_rules.py SOURCE_ROOT
"""
import os
import re
import sys


def header_limit(style):
    m = re.search(r"No header over (\d+) lines", open(style, encoding="utf-8").read())
    return int(m.group(1)) if m else None


def main():
    root = sys.argv[1]
    include = os.path.join(root, "include")
    problems = []

    limit = header_limit(os.path.join(root, "docs", "style.md"))
    if limit is None:
        problems.append("docs/style.md states no 'No header over N lines' rule")
    else:
        checked = 0
        for dirpath, _, files in os.walk(os.path.join(include, "loom")):
            for name in sorted(files):
                if not name.endswith(".hpp"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    lines = sum(1 for _ in f)
                checked += 1
                if lines > limit:
                    problems.append(f"{os.path.relpath(path, root)} has {lines} lines (docs/style.md: at most {limit})")
        if checked == 0:
            problems.append("no header found under include/loom")

    design = open(os.path.join(root, "docs", "design.md"), encoding="utf-8").read()
    named = sorted(set(re.findall(r"`(loom/[a-z0-9_/]+\.hpp)`", design)))
    for rel in named:
        if not os.path.isfile(os.path.join(include, rel)):
            problems.append(f"docs/design.md names {rel}, which does not exist")
    if len(named) < 10:
        problems.append(f"docs/design.md names only {len(named)} headers as `loom/.../x.hpp`")

    section = re.search(r"^## Where to look\n(.*?)(?=^## |\Z)", design, re.S | re.M)
    if not section:
        problems.append("docs/design.md has no '## Where to look' section")
    else:
        rows = [r for r in section.group(1).splitlines() if r.startswith("|") and "---" not in r]
        answered = [r for r in rows[1:] if re.search(r"`loom/[a-z0-9_/]+\.hpp`", r)]
        if len(answered) < 4 or len(answered) != len(rows) - 1:
            problems.append("docs/design.md's 'Where to look' table has a row without a `loom/.../x.hpp` file")

    style = open(os.path.join(root, "docs", "style.md"), encoding="utf-8").read()
    if "Tests mirror `include/loom/`" not in style:
        problems.append("docs/style.md states no 'Tests mirror `include/loom/`' rule")
    else:
        for folder in sorted(os.listdir(os.path.join(include, "loom"))):
            if not os.path.isdir(os.path.join(include, "loom", folder)) or folder == "detail":
                continue
            tests = os.path.join(root, "tests", "gpu" if folder == "cuda" else folder)
            if not os.path.isdir(tests) or not any(n.endswith((".cpp", ".py", ".sh")) for n in os.listdir(tests)):
                problems.append(f"include/loom/{folder}/ has no tests in {os.path.relpath(tests, root)}/")

    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    print(f"ok: every header within {limit} lines; docs/design.md's {len(named)} named headers exist")
    return 0


if __name__ == "__main__":
    sys.exit(main())

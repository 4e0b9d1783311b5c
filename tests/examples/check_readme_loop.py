#!/usr/bin/env python3
"""The README's loop has one source: examples/readme_loop.cpp, between its markers
"// ---- the loop (README) ----" and "// ---- end of the loop ----" (compiled and run by the tests).

Checks that the first ```cpp block under "## The loop" in README.md, and the loom block in
docs/loop.md, contain that region's lines, in order and contiguous, compared without their
indentation (the blocks wrap the region in loom::run and place it at another depth). Exit 1 with the
first differing line otherwise.

Usage: check_readme_loop.py SOURCE_ROOT
"""
import pathlib
import sys

BEGIN = "// ---- the loop (README) ----"
END = "// ---- end of the loop ----"


def region(example: str) -> list[str]:
    lines = [l.strip() for l in example.splitlines()]
    return lines[lines.index(BEGIN) + 1 : lines.index(END)]


def block_after(text: str, heading: str) -> list[str]:
    """The lines of the first ```cpp block after the line `heading`."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(heading))
    open_ = next(i for i in range(start, len(lines)) if lines[i].strip() == "```cpp")
    close = next(i for i in range(open_ + 1, len(lines)) if lines[i].strip() == "```")
    return [l.strip() for l in lines[open_ + 1 : close]]


def check(name: str, block: list[str], want: list[str]) -> bool:
    for at in range(len(block) - len(want) + 1):
        if block[at : at + len(want)] == want:
            return True
    # Report the first line of the region that the block misses, aligned at the region's first line.
    if want[0] not in block:
        print(f"{name}: the loop's first line is missing (examples/readme_loop.cpp's marked region):\n  {want[0]}")
        return False
    at = block.index(want[0])
    for k, line in enumerate(want):
        got = block[at + k] if at + k < len(block) else "(end of block)"
        if got != line:
            print(f"{name}: the loop differs from examples/readme_loop.cpp's marked region at its line {k + 1}:\n"
                  f"  example: {line}\n  {name}: {got}")
            return False
    return False


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    want = region((root / "examples/readme_loop.cpp").read_text())
    if not want:
        print("examples/readme_loop.cpp: the marked region is empty")
        return 1
    ok = check("README.md", block_after((root / "README.md").read_text(), "## The loop"), want)
    ok &= check("docs/loop.md", block_after((root / "docs/loop.md").read_text(), "**loom**"), want)
    if ok:
        print(f"README.md and docs/loop.md show the example's {len(want)} loop lines")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

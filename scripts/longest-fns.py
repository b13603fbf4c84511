#!/usr/bin/env python3
"""The longest Rust functions under some directories, for keeping protocol steps short.

    scripts/longest-fns.py N DIR...     # e.g. scripts/longest-fns.py 12 src fsdp-ckpt/src

Prints the N longest as `LINES FILE:LINE NAME`, counting from the `fn` line to its closing
brace by brace counting (text only: braces inside strings or comments count too), and skips
`#[cfg(test)] mod` blocks.
"""
import os
import re
import sys

FN = re.compile(r"\s*(pub(\([^)]*\))?\s+)?(async\s+)?(unsafe\s+)?(const\s+)?fn\s+(\w+)")


def block_end(lines, i):
    """Index of the line closing the block that opens at or after line `i`, or None."""
    depth, opened = 0, False
    for k in range(i, len(lines)):
        depth += lines[k].count("{") - lines[k].count("}")
        opened = opened or "{" in lines[k]
        if opened and depth == 0:
            return k
        if not opened and lines[k].rstrip().endswith(";"):
            return None  # a declaration without a body
    return None


def functions(path):
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        if re.match(r"\s*#\[cfg\(test\)\]", lines[i]) and i + 1 < len(lines) \
                and re.match(r"\s*mod \w+ \{", lines[i + 1]):
            i = (block_end(lines, i + 1) or i) + 1
            continue
        m = FN.match(lines[i])
        if m:
            end = block_end(lines, i)
            if end is not None:
                yield end - i + 1, f"{path}:{i + 1} {m.group(6)}"
        i += 1


def main():
    n, dirs = int(sys.argv[1]), sys.argv[2:]
    found = []
    for root in dirs:
        for d, _, files in os.walk(root):
            found += [f for name in files if name.endswith(".rs")
                      for f in functions(os.path.join(d, name))]
    for length, where in sorted(found, reverse=True)[:n]:
        print(length, where)


if __name__ == "__main__":
    main()

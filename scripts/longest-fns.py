#!/usr/bin/env python3
"""The longest Rust functions under some directories, for keeping protocol steps short.

    scripts/longest-fns.py N DIR...            # the N longest, e.g. 12 src fsdp-ckpt/src
    scripts/longest-fns.py --max 120 DIR...    # every function over 120 lines; exit 1 if any

Prints `LINES FILE:LINE NAME`, counting from the `fn` line to the line of its closing brace.
Braces are counted in code only: comments (line, block, nested block, doc), string literals
(plain, byte, raw with any number of `#`) and char literals (`'{'`, `b'}'`, escapes) are
skipped, while lifetimes (`'a`) are not mistaken for chars. `#[cfg(test)] mod` blocks are
skipped. .ci/run runs the `--max 120` form over src, fsdp-ckpt/src and python/src.
"""
import os
import re
import sys

FN = re.compile(r"\s*(pub(\([^)]*\))?\s+)?(default\s+)?(async\s+)?(unsafe\s+)?(const\s+)?"
                r"(extern\s+\"\w+\"\s+)?fn\s+(\w+)")
CHAR = re.compile(r"b?'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.)|[^\\'\n])'")
RAW = re.compile(r"b?r(#*)\"")


def code_only(text):
    """`text` with every comment, string and char literal blanked (newlines kept), so that
    the braces left are the code's."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif (m := RAW.match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i)
                          and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif (c == "'" or (c == "b" and text.startswith("b'", i))) and (m := CHAR.match(text, i)):
            out.append(" " * (m.end() - i))
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(lines, i):
    """Index of the line closing the block that opens at or after line `i`, or None."""
    depth, opened = 0, False
    for k in range(i, len(lines)):
        for ch in lines[k]:
            if ch == "{":
                depth, opened = depth + 1, True
            elif ch == "}":
                depth -= 1
                if opened and depth == 0:
                    return k
            elif ch == ";" and not opened:
                return None  # a declaration without a body
    return None


def functions(path):
    raw = open(path, encoding="utf-8").read().split("\n")
    lines = code_only("\n".join(raw)).split("\n")
    i = 0
    while i < len(lines):
        if re.match(r"\s*#\[cfg\(test\)\]", raw[i]) and i + 1 < len(lines) \
                and re.match(r"\s*(pub(\([^)]*\))?\s+)?mod \w+ \{", lines[i + 1]):
            i = (block_end(lines, i + 1) or i) + 1
            continue
        m = FN.match(lines[i])
        if m:
            end = block_end(lines, i)
            if end is not None:
                yield end - i + 1, f"{path}:{i + 1} {m.group(8)}"
        i += 1


def main():
    args = sys.argv[1:]
    limit = None
    if args[:1] == ["--max"]:
        limit, dirs = int(args[1]), args[2:]
    else:
        n, dirs = int(args[0]), args[1:]
    found = []
    for root in dirs:
        for d, _, files in os.walk(root):
            found += [f for name in sorted(files) if name.endswith(".rs")
                      for f in functions(os.path.join(d, name))]
    found.sort(key=lambda f: (-f[0], f[1]))
    if limit is None:
        for length, where in found[:n]:
            print(length, where)
        return 0
    over = [(length, where) for length, where in found if length > limit]
    for length, where in over:
        print(length, where)
    if over:
        print(f"{len(over)} function(s) over {limit} lines: split them into named phases",
              file=sys.stderr)
        return 1
    print(f"no function over {limit} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check that pairs of torch.save files hold the same object, exactly.

    check_equal.py EXPECTED.pt ACTUAL.pt [EXPECTED2.pt ACTUAL2.pt ...]

Both are loaded with `torch.load(weights_only=True)`; they must have the same structure
(types: dict vs OrderedDict, list vs tuple, int vs str keys), the same key order, equal
non-tensor values (floats by bits) and tensors of the same dtype, shape and bytes. Exits
non-zero with the first difference.
"""

import struct
import sys

import torch


def same(a, b, path):
    if type(a) is not type(b):
        raise SystemExit(f"{path}: {type(a).__name__} vs {type(b).__name__}")
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise SystemExit(f"{path}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
        ab = a.contiguous().reshape(-1).view(torch.uint8)
        bb = b.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ab, bb):
            raise SystemExit(f"{path}: tensor bytes differ")
    elif isinstance(a, dict):
        if list(a.keys()) != list(b.keys()):
            raise SystemExit(f"{path}: keys {list(a.keys())} vs {list(b.keys())}")
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise SystemExit(f"{path}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            raise SystemExit(f"{path}: {a!r} vs {b!r}")
    elif a != b:
        raise SystemExit(f"{path}: {a!r} vs {b!r}")


def main():
    args = sys.argv[1:]
    if not args or len(args) % 2:
        raise SystemExit("usage: check_equal.py EXPECTED.pt ACTUAL.pt [...]")
    for e, a in zip(args[::2], args[1::2]):
        expected = torch.load(e, weights_only=True)
        actual = torch.load(a, weights_only=True)
        same(expected, actual, a)
    print("equal")


if __name__ == "__main__":
    main()

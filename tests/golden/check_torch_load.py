"""Describe torch.save contents as JSON, and check files against such descriptions.

As a library (imported by torch_save_fixtures.py): `describe(obj)` gives the JSON form the
Rust tests compare with, bit for bit.

As a script: `check_torch_load.py DIR` loads every `DIR/*.pt` with
`torch.load(path, weights_only=True)` and compares it with `DIR/<name>.json`, which holds
{"object": <describe form>, "shared": [[path, path, ...], ...]} where each group of paths
must view one storage. Exits non-zero with a message on the first difference.
"""

import collections
import json
import struct
import sys
from pathlib import Path

import torch

DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.uint16: "u16",
    torch.uint32: "u32",
    torch.uint64: "u64",
    torch.float8_e4m3fn: "f8e4m3fn",
    torch.float8_e5m2: "f8e5m2",
}


def tensor_bytes(t):
    c = t.detach().clone().contiguous().reshape(-1)
    return bytes(c.untyped_storage().tolist())


def describe(obj):
    """JSON-able description of a torch.save object; floats as their IEEE-754 bits."""
    if obj is None:
        return {"none": None}
    if isinstance(obj, bool):
        return {"bool": obj}
    if isinstance(obj, int):
        return {"int": str(obj)}
    if isinstance(obj, float):
        return {"float": str(struct.unpack("<Q", struct.pack("<d", obj))[0])}
    if isinstance(obj, str):
        return {"str": obj}
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    if isinstance(obj, torch.Tensor):
        return {
            "tensor": {
                "dtype": DTYPES[obj.dtype],
                "shape": list(obj.shape),
                "hex": tensor_bytes(obj).hex(),
            }
        }
    if isinstance(obj, torch.Size):  # before tuple: a torch.Size is one
        return {"size": list(obj)}
    if isinstance(obj, tuple):
        return {"tuple": [describe(x) for x in obj]}
    if isinstance(obj, list):
        return {"list": [describe(x) for x in obj]}
    if isinstance(obj, collections.OrderedDict):
        attrs = [[k, describe(v)] for k, v in vars(obj).items()]
        return {"odict": [[describe(k), describe(v)] for k, v in obj.items()], "attrs": attrs}
    if isinstance(obj, dict):
        return {"dict": [[describe(k), describe(v)] for k, v in obj.items()]}
    raise TypeError(f"cannot describe {type(obj)}")


def lookup(obj, path):
    for key in path:
        obj = obj[key]
    return obj


def check(dir_):
    files = sorted(Path(dir_).glob("*.pt"))
    if not files:
        sys.exit(f"no .pt files in {dir_}")
    for pt in files:
        expected = json.loads(pt.with_suffix(".json").read_text())
        obj = torch.load(pt, weights_only=True)
        got = describe(obj)
        if got != expected["object"]:
            sys.exit(
                f"{pt}: loaded object differs from the expectation\n"
                f"got:      {json.dumps(got)[:2000]}\nexpected: {json.dumps(expected['object'])[:2000]}"
            )
        for group in expected.get("shared", []):
            ptrs = {lookup(obj, p).untyped_storage().data_ptr() for p in group}
            if len(ptrs) != 1:
                sys.exit(f"{pt}: tensors {group} should share one storage")
        print(f"ok {pt.name}")


if __name__ == "__main__":
    check(sys.argv[1])

"""Checks that Python's safetensors reads what `fsdp-ckpt convert` writes (tests/cli.rs).

    python check_safetensors.py DIR ORIGINAL.pt...

For each ORIGINAL.pt, DIR/<stem>.safetensors must hold, under the documented names (the path
of dict keys and list indices joined with '/'), exactly the tensors of torch.load(ORIGINAL):
same names, dtypes, shapes and bits. Prints `ok <stem>` per file; exits non-zero otherwise.
"""
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def walk(obj, path, out):
    if isinstance(obj, torch.Tensor):
        out[path or "tensor"] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            walk(v, f"{path}/{k}" if path else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            walk(v, f"{path}/{i}" if path else str(i), out)


def main():
    out_dir, originals = sys.argv[1], sys.argv[2:]
    for pt in originals:
        stem = os.path.splitext(os.path.basename(pt))[0]
        st = os.path.join(out_dir, stem + ".safetensors")
        expected = {}
        walk(torch.load(pt, weights_only=True), "", expected)
        got = load_file(st)
        assert sorted(got) == sorted(expected), (stem, sorted(got), sorted(expected))
        for name, t in expected.items():
            g = got[name]
            assert g.dtype == t.dtype and g.shape == t.shape, (stem, name, g.dtype, t.dtype)
            assert torch.equal(g.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)) if t.numel() and t.dim() else torch.equal(g, t) or (g != g and t != t), (stem, name)
        with safe_open(st, framework="pt") as f:
            meta = f.metadata()
            assert meta.get("format") == "pt", meta
            assert "fsdp.pyobj.v1" in meta, meta
        print("ok", stem)


if __name__ == "__main__":
    main()

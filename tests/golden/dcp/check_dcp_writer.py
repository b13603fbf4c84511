"""Check DCP directories written by the crate against PyTorch's own `torch_save_to_dcp`.

    check_dcp_writer.py IN.pt OUT_DIR [IN2.pt OUT_DIR2 ...]

For each pair: PyTorch writes `torch_save_to_dcp(IN.pt, ref)`; `dcp_to_torch_save` of `ref`
and of OUT_DIR must give the same object exactly (structure, key order, types, tensor bytes);
and `dcp.load` into a zeroed copy of IN's state dict must restore IN's tensors bit for bit.
Exits non-zero with the first difference.
"""

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_equal import same  # noqa: E402


def zeroed(obj):
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return type(obj)((k, zeroed(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [zeroed(v) for v in obj]
    return obj


def tensors(obj, path=""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]")


def check(src, ours):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch_save_to_dcp(src, tmp / "ref")
        dcp_to_torch_save(tmp / "ref", tmp / "ref.pt")
        dcp_to_torch_save(ours, tmp / "ours.pt")
        same(
            torch.load(tmp / "ref.pt", weights_only=True),
            torch.load(tmp / "ours.pt", weights_only=True),
            f"{ours}",
        )
    original = torch.load(src, weights_only=True)
    target = zeroed(original)
    dcp.load(target, checkpoint_id=ours)
    for (p, a), (_, b) in zip(tensors(original), tensors(target)):
        same(a, b, f"dcp.load {ours}{p}")


def main():
    args = sys.argv[1:]
    if not args or len(args) % 2:
        raise SystemExit("usage: check_dcp_writer.py IN.pt OUT_DIR [...]")
    for src, ours in zip(args[::2], args[1::2]):
        check(src, ours)
    print("equal")


if __name__ == "__main__":
    main()

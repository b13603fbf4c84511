"""Writes tests/golden/dcp/shared_storage/input.pt for tests/it/dcp.rs: a state dict whose
tensors are views into shared storages, as `torch.save` keeps them (one storage entry per
storage, each tensor a `(storage, offset, size, stride)` view of it).

Run from the crate root with PyTorch 2.13:  .venv/bin/python tests/golden/dcp/shared_storage/gen.py

Coverage, in state-dict order:
* `model.flat.*` — views of one float32 storage of 64 elements (values 1000..1063, unique in
  the file): a [3, 4] view at offset 0, a transposed [4, 3] view (non-contiguous), a view
  with step 2, and, far later in the dict, `optim.state.late` at offset 40 (the storage's
  views are apart in state-dict order);
* `model.tied_a` / `model.tied_b` — one tensor object saved twice (tied weights), itself a
  view at an offset of a bfloat16 storage that is larger than its views;
* `model.emb` and `model.head` — two tensor objects over one whole int64 storage (tied
  embedding and head);
* `model.expanded` — a stride-0 view (`expand`) of a 3-element storage;
* `model.plain` — a tensor that is its whole storage (streamed as before);
* `model.one` and `model.empty` — a 1-element and a 0-element view of the float32 storage;
* `optim.step` / `optim.lr` — non-tensor values, and `optim.state.exp_avg`, a float64 column
  of a [5, 4] matrix (stride 4, offset 1).
"""

from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "input.pt"


def main():
    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    flat = torch.arange(1000, 1064, dtype=torch.float32)
    half = torch.arange(48, dtype=torch.float32).to(torch.bfloat16)
    tied = half[8:20].view(3, 4)
    ids = torch.arange(-12, 12, dtype=torch.int64)
    three = torch.tensor([7.25, -3.5, 0.125])
    mat = torch.arange(20, dtype=torch.float64).view(5, 4) * 0.5
    obj = {
        "model": {
            "flat.a": flat[0:12].view(3, 4),
            "flat.t": flat[12:24].view(3, 4).t(),
            "flat.step2": flat[24:40:2],
            "tied_a": tied,
            "tied_b": tied,
            "emb": ids.view(4, 6),
            "head": ids.view(6, 4),
            "expanded": three.expand(4, 3),
            "plain": torch.linspace(-1, 1, 10),
            "one": flat[63:64],
            "empty": flat[5:5],
        },
        "optim": {
            "step": 7,
            "lr": 0.001,
            "state": {
                "exp_avg": mat[:, 1],
                "late": flat[40:56].view(2, 8),
            },
        },
    }
    torch.save(obj, OUT)
    back = torch.load(OUT, weights_only=True)
    a, t = back["model"]["flat.a"], back["model"]["flat.t"]
    assert a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), "shared storage"
    assert not t.is_contiguous() and back["optim"]["state"]["late"].storage_offset() == 40
    print("wrote", OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()

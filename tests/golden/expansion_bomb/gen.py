"""Writes tests/golden/expansion_bomb/expansion_bomb.pt for tests/torch_save_bomb.rs.

200 tensors, each a stride-0 [4096, 4096] float32 view of one 4-element storage: a 28 KB file
whose tensors, materialized, are 64 MiB each (12.8 GiB in all). Each alone stays within the
old per-tensor expansion cap (storage bytes + 64 MiB).

    .venv/bin/python tests/golden/expansion_bomb/gen.py
"""
from pathlib import Path

import torch

OUT = Path(__file__).parent / "expansion_bomb.pt"


def main():
    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    base = torch.arange(4, dtype=torch.float32)
    obj = {f"t{i}": base.as_strided((4096, 4096), (0, 0), i % 4) for i in range(200)}
    torch.save(obj, OUT)
    print("wrote", OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()

"""FSDP2 layout fixture from REAL PyTorch 2.13 for `tests/it/fsdp2_layout.rs`.

Run manually from the crate root with the project's venv, and commit the output:

    .venv/bin/python tests/golden/fsdp2/gen.py

For world sizes 2, 3 and 4 it spawns the ranks with `torch.multiprocessing` (gloo, CPU,
`init_device_mesh("cpu", (ws,))`), applies `fully_shard` to `layers.0`, `layers.1` and then
the root (with the 0-dim `extra.step` in `ignored_params`), and records in `layout.json`:

* `model`: `named_parameters()` of the unwrapped model (first names, shapes, dtypes,
  `requires_grad`) and the tied alias;
* `units` and `ignored_modules`: what `fully_shard` was applied to and what it ignored;
* per world size, each `fully_shard` group's parameters in `FSDPParamGroup` order, and per
  rank and parameter the local shape and the global offset of its local tensor (or
  `"replicated"` for a parameter that stays a plain tensor);
* `scalar_refused`: `fully_shard`'s message for a 0-dim parameter inside a unit.

The model has uneven rows (10 and 6 rows on 4 ranks), a root-level parameter registered before
the children (group order is module post-order), an embedding tied to the output head, a frozen
parameter and a bf16 block next to fp32 ones.
"""

import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

ROOT = Path(__file__).resolve().parent
WORLD_SIZES = [2, 3, 4]
UNITS = ["layers.0", "layers.1", ""]
IGNORED = ["extra"]


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.attn = nn.Linear(4, 6, dtype=dtype)
        self.norm = nn.LayerNorm(6, dtype=dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(torch.float32), Block(torch.bfloat16)])
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.extra = nn.Module()
        self.extra.step = nn.Parameter(torch.tensor(0.0))
        self.layers[0].norm.weight.requires_grad_(False)


DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def describe(model):
    params = [
        {
            "name": n,
            "shape": list(p.shape),
            "dtype": DTYPES[p.dtype],
            "requires_grad": p.requires_grad,
        }
        for n, p in model.named_parameters()
    ]
    return {"params": params, "tied": {"head.weight": "embed.weight"}}


def worker(rank, ws, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.layers[0], mesh=mesh)
    fully_shard(model.layers[1], mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params={model.extra.step})
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for unit in UNITS:
        module = model.get_submodule(unit) if unit else model
        group = module._get_fsdp_state()._fsdp_param_group
        groups.append([names[id(fp.sharded_param)] for fp in group.fsdp_params])
    local = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, p.device_mesh, p.placements
            )
            assert list(shape) == list(p.to_local().shape), n
            local[n] = {"shape": list(shape), "offset": list(offset)}
        else:
            local[n] = "replicated"
    (out / f"rank{rank}.json").write_text(json.dumps({"groups": groups, "local": local}))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ws):
    for attempt in range(4):
        out = Path(tempfile.mkdtemp())
        try:
            mp.spawn(worker, args=(ws, free_port(), out), nprocs=ws, join=True)
        except Exception as e:  # gloo sometimes aborts a process at exit after the work
            print(f"ws {ws}: attempt {attempt} raised {e!r}", file=sys.stderr)
        ranks = [out / f"rank{r}.json" for r in range(ws)]
        if all(f.exists() for f in ranks):
            results = [json.loads(f.read_text()) for f in ranks]
            shutil.rmtree(out)
            assert all(r["groups"] == results[0]["groups"] for r in results)
            return {
                "world_size": ws,
                "groups": results[0]["groups"],
                "ranks": [r["local"] for r in results],
            }
        shutil.rmtree(out)
    raise SystemExit(f"ws {ws}: no complete result after 4 attempts")


def scalar_refused():
    """fully_shard's check on a managed 0-dim parameter (it runs before any communication)."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _verify_managed_param

    try:
        _verify_managed_param("step", nn.Parameter(torch.tensor(0.0)))
    except ValueError as e:
        return str(e)
    raise SystemExit("fully_shard accepted a scalar parameter")


def main():
    result = {
        "torch": torch.__version__,
        "model": describe(Net()),
        "units": UNITS,
        "ignored_modules": IGNORED,
        "layouts": [run(ws) for ws in WORLD_SIZES],
        "scalar_refused": scalar_refused(),
    }
    (ROOT / "layout.json").write_text(json.dumps(result, indent=1) + "\n")
    print("layout.json: ok")


if __name__ == "__main__":
    main()

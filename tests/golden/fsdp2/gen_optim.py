"""FSDP2 optimizer-state fixtures from REAL PyTorch 2.13 for `fsdp-ckpt consolidate-torch` and
`shard-torch` with `"fsdp_version": 2` (`fsdp-ckpt/tests/cli_fsdp2.rs`).

Run manually from the crate root with the project's venv, and commit the output:

    .venv/bin/python tests/golden/fsdp2/gen_optim.py

The model (`desc.json`): an embedding of 7 rows tied to the output head, two blocks with 5-row
linears, a frozen LayerNorm weight and a `small` parameter of 2 rows (rank 2 of 3 holds none of
it). `fully_shard` goes on `layers.0`, `layers.1`, then the root, on
`init_device_mesh("cpu", (ws,))` over gloo. Optimizers (`optim/<name>/`): Adam with amsgrad,
AdamW with two param groups, SGD with momentum, all over `model.parameters()` (the frozen
weight included, without state). For world sizes 2 and 3 it trains two steps and writes

* `ws{N}/rank{r}.pt`: rank r's `optim.state_dict()`, every DTensor replaced by `to_local()`;
* `ws{N}/full.pt`: `get_optimizer_state_dict(model, optim, full_state_dict=True)` (rank 0's);
* `ws{N}/load{r}.pt`: rank r's local dict (as `rank{r}.pt`) after a fresh model and optimizer
  at world size N loaded the OTHER world size's `full.pt` with `set_optimizer_state_dict`.
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent / "optim"
WORLD_SIZES = [2, 3]
UNITS = ["layers.0", "layers.1", ""]
OPTIMIZERS = ["adam_amsgrad", "adamw", "sgd"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.out = nn.Linear(5, 4)

    def forward(self, x):
        return x + self.out(torch.relu(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(4)
        self.small = nn.Parameter(torch.randn(2, 3))
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight
        self.norm.weight.requires_grad_(False)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.layers:
            x = b(x)
        return self.head(self.norm(x)).sum() + (self.small**2).sum()


def describe(model):
    params = [
        {"name": n, "shape": list(p.shape), "dtype": "f32", "requires_grad": p.requires_grad}
        for n, p in model.named_parameters()
    ]
    return {"params": params, "tied": {"head.weight": "embed.weight"}}


def adamw_groups(names):
    decay = [n for n in names if n.endswith("weight")]
    return [decay, [n for n in names if n not in decay]]


def make_optimizer(name, model):
    named = list(model.named_parameters())
    if name == "adam_amsgrad":
        return torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    if name == "adamw":
        groups = adamw_groups([n for n, _ in named])
        by_name = dict(named)
        return torch.optim.AdamW(
            [
                {"params": [by_name[n] for n in groups[0]], "weight_decay": 0.1},
                {"params": [by_name[n] for n in groups[1]], "weight_decay": 0.0},
            ],
            lr=1e-2,
        )
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def desc(name):
    model = Net()
    spec = {"model": describe(model), "policy": {"units": UNITS, "fsdp_version": 2}}
    if name == "adamw":
        groups = adamw_groups([n for n, _ in model.named_parameters()])
        spec["optim_params"] = {
            "groups": [[{"Param": n} for n in g] for g in groups],
            "named": False,
        }
    return spec


def wrapped(ws):
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.layers[0], mesh=mesh)
    fully_shard(model.layers[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_dict(optim):
    sd = optim.state_dict()
    state = {
        k: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in st.items()}
        for k, st in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def train(rank, ws, out):
    for name in OPTIMIZERS:
        model = wrapped(ws)
        optim = make_optimizer(name, model)
        torch.manual_seed(1 + rank)
        for _ in range(2):
            model(torch.randint(0, 7, (3, 2))).backward()
            optim.step()
            optim.zero_grad()
        d = out / name / f"ws{ws}"
        torch.save(local_dict(optim), d / f"rank{rank}.pt")
        opts = StateDictOptions(full_state_dict=True)
        full = get_optimizer_state_dict(model, optim, options=opts)
        if rank == 0:
            torch.save(full, d / "full.pt")


def load(rank, ws, out):
    other = 5 - ws
    for name in OPTIMIZERS:
        model = wrapped(ws)
        optim = make_optimizer(name, model)
        full = torch.load(out / name / f"ws{other}" / "full.pt", weights_only=True)
        opts = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optim, full, options=opts)
        torch.save(local_dict(optim), out / name / f"ws{ws}" / f"load{rank}.pt")


def worker(rank, ws, port, out, phase):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    phase(rank, ws, out)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(ws, phase, expected):
    for attempt in range(4):
        try:
            mp.spawn(worker, args=(ws, free_port(), ROOT, phase), nprocs=ws, join=True)
        except Exception as e:  # gloo sometimes aborts a process at exit after the work
            print(f"ws {ws}: attempt {attempt} raised {e!r}", file=sys.stderr)
        if all(f.exists() for f in expected):
            return
        for f in expected:
            f.unlink(missing_ok=True)
    raise SystemExit(f"ws {ws} {phase.__name__}: no complete result after 4 attempts")


def main():
    shutil.rmtree(ROOT, ignore_errors=True)
    for name in OPTIMIZERS:
        for ws in WORLD_SIZES:
            (ROOT / name / f"ws{ws}").mkdir(parents=True)
        (ROOT / name / "desc.json").write_text(json.dumps(desc(name), indent=1) + "\n")
    files = lambda ws, f: [ROOT / n / f"ws{ws}" / f for n in OPTIMIZERS]  # noqa: E731
    for ws in WORLD_SIZES:
        expected = [p for r in range(ws) for p in files(ws, f"rank{r}.pt")] + files(ws, "full.pt")
        spawn(ws, train, expected)
    for ws in WORLD_SIZES:
        spawn(ws, load, [p for r in range(ws) for p in files(ws, f"load{r}.pt")])
    (ROOT / "torch_version.txt").write_text(torch.__version__ + "\n")
    print("optim fixtures: ok")


if __name__ == "__main__":
    main()

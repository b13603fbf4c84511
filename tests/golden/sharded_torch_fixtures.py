"""Generates the per-rank SHARDED optimizer state dict fixtures of tests/sharded_torch.rs.

Two gloo CPU ranks train a small model with Adam for two steps, once with FSDP1 and once
with FSDP2, and each rank `torch.save`s its sharded optimizer state dict; rank 0 also saves
the full dict PyTorch consolidates from the same state. Written into
tests/golden/sharded_torch/<case>/:
  fsdp1/rank{r}.pt  FSDP.optim_state_dict(model, optim) under StateDictType.SHARDED_STATE_DICT
                    (ShardedTensor states, FQN keys)
  fsdp1/full.pt     FSDP.optim_state_dict under FULL_STATE_DICT (offload_to_cpu=False)
  fsdp2/rank{r}.pt  optim.state_dict() of a fully_shard model on init_device_mesh("cpu", (2,))
                    (DTensor states, int keys)
  fsdp2/full.pt     get_optimizer_state_dict(model, optim, full_state_dict=True) (FQN keys)
  fsdp2/full_ids.pt optim.state_dict() with every DTensor replaced by .full_tensor()
  fsdp2/names.json  the FQN of each optimizer parameter id, in id order

gloo sometimes aborts a process at exit after all work is done, so a run whose outputs are
incomplete is retried.

    .venv/bin/python tests/golden/sharded_torch_fixtures.py
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_torch")
WORLD = 2


class Model(nn.Module):
    # Odd first dimensions so that dim-0 chunks are uneven, and a [1] bias that leaves
    # rank 1 without a chunk.
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 5)
        self.blocks = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1))
        self.head = nn.Linear(1, 2)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def train(model, rank):
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        loss = model(torch.randn(5, 4)).pow(2).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
    return optim


def fsdp1(rank, out):
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = Model()
    kw = dict(device_id=torch.device("cpu"), use_orig_params=False)
    model.blocks[0] = FSDP(model.blocks[0], **kw)
    model.blocks[2] = FSDP(model.blocks[2], **kw)
    model = FSDP(model, **kw)
    optim = train(model, rank)
    FSDP.set_state_dict_type(
        model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(offload_to_cpu=False),
        ShardedOptimStateDictConfig(offload_to_cpu=False),
    )
    torch.save(FSDP.optim_state_dict(model, optim), os.path.join(out, f"rank{rank}.pt"))
    FSDP.set_state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    )
    full = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))


def fsdp2(rank, out):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = Model()
    fully_shard(model.blocks[0], mesh=mesh)
    fully_shard(model.blocks[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = train(model, rank)
    osd = optim.state_dict()
    torch.save(osd, os.path.join(out, f"rank{rank}.pt"))
    full_ids = {
        "state": {
            k: {n: (v.full_tensor() if isinstance(v, DTensor) else v) for n, v in st.items()}
            for k, st in osd["state"].items()
        },
        "param_groups": osd["param_groups"],
    }
    full = get_optimizer_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    if rank == 0:
        torch.save(full_ids, os.path.join(out, "full_ids.pt"))
        torch.save(full, os.path.join(out, "full.pt"))
        with open(os.path.join(out, "names.json"), "w") as f:
            json.dump([n for n, _ in model.named_parameters()], f)


def run(rank, port, case):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out = os.path.join(HERE, case)
    {"fsdp1": fsdp1, "fsdp2": fsdp2}[case](rank, out)
    dist.barrier()
    dist.destroy_process_group()


def outputs(case):
    names = [f"rank{r}.pt" for r in range(WORLD)] + ["full.pt"]
    if case == "fsdp2":
        names += ["full_ids.pt", "names.json"]
    return [os.path.join(HERE, case, n) for n in names]


def main():
    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    for i, case in enumerate(["fsdp1", "fsdp2"]):
        os.makedirs(os.path.join(HERE, case), exist_ok=True)
        for attempt in range(5):
            for p in outputs(case):
                if os.path.exists(p):
                    os.remove(p)
            try:
                mp.spawn(run, args=(29750 + 10 * i + attempt, case), nprocs=WORLD, join=True)
            except Exception as e:  # noqa: BLE001 - gloo's exit-time aborts; retried below
                print(f"{case}: attempt {attempt} failed: {e}", file=sys.stderr)
            if all(os.path.exists(p) for p in outputs(case)):
                break
        else:
            sys.exit(f"{case}: no complete output after 5 attempts")
        print("wrote", os.path.join(HERE, case), file=sys.stderr)


if __name__ == "__main__":
    main()

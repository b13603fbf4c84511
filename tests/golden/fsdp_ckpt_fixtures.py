"""Generates the PyTorch FSDP fixtures of tests/cli.rs (run with the venv's python).

Two gloo CPU ranks train a small nested model with Adam for two steps, wrapped as
FSDP(blocks.0), FSDP(blocks.2) and the root, once with use_orig_params=False and once with
True. Each run writes into tests/golden/fsdp_ckpt/<case>/:
  desc.json      the model description + wrapping policy (fsdp::commands::rank_dicts::DescFile)
  rank{r}.pt     rank r's local optim.state_dict()
  full.pt        the full optimizer state dict (FSDP.optim_state_dict, FULL_STATE_DICT,
                 offload_to_cpu=False) from rank 0
  shard{r}.pt    FSDP.shard_full_optim_state_dict(full, model, optim) on rank r

    .venv/bin/python tests/golden/fsdp_ckpt_fixtures.py
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_ckpt")
WORLD = 2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.blocks = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def desc(use_orig):
    m = Model()
    params = [
        {"name": n, "shape": list(p.shape), "dtype": "f32"} for n, p in m.named_parameters()
    ]
    return {
        "model": {"params": params},
        "policy": {"units": ["blocks.0", "blocks.2", ""], "use_orig_params": use_orig},
    }


def run(rank, port, case, use_orig):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = Model()
    kw = dict(device_id=cpu, use_orig_params=use_orig)
    model.blocks[0] = FSDP(model.blocks[0], **kw)
    model.blocks[2] = FSDP(model.blocks[2], **kw)
    model = FSDP(model, **kw)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        loss = model(torch.randn(5, 4)).pow(2).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
    out = os.path.join(HERE, case)
    torch.save(optim.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    # FSDP.full_optim_state_dict offloads to CPU, where with use_orig_params=True every
    # gathered state aliases one reused buffer (exp_avg comes out equal to exp_avg_sq, a
    # CPU-only PyTorch bug); the same dict without offloading is the GPU-correct one.
    FSDP.set_state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
    )
    full = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))
    shard = FSDP.shard_full_optim_state_dict(full, model, optim=optim)
    torch.save(shard, os.path.join(out, f"shard{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
    for i, (case, use_orig) in enumerate([("flat", False), ("orig", True)]):
        out = os.path.join(HERE, case)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "desc.json"), "w") as f:
            json.dump(desc(use_orig), f, indent=1)
        mp.spawn(run, args=(29650 + i, case, use_orig), nprocs=WORLD, join=True)
        print("wrote", out, file=sys.stderr)


if __name__ == "__main__":
    main()

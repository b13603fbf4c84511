"""Rank processes of `test_describe.py`: each builds and wraps a model exactly as the golden
generator that wrote the fixture did, then calls `fsdp_ckpt.write_desc` (a collective)."""

import importlib.util
import os
import warnings

import torch
import torch.distributed as dist

import fsdp_ckpt
from conftest import GOLDEN


def golden_module(relative: str, name: str):
    """A golden generator script, imported by path (its `main` does not run)."""
    spec = importlib.util.spec_from_file_location(name, GOLDEN / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def init(rank: int, ws: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=ws)


def fsdp1(rank, ws, port, scenario, load_name, out):
    """`tests/golden/gen.py`'s scenario (or one of its load targets), FSDP1."""
    gen = golden_module("gen.py", "golden_fsdp1_gen")
    init(rank, ws, port)
    try:
        cfg = gen.SCENARIOS[scenario]
        c = dict(cfg)
        if load_name:
            c.update(cfg["loads"][load_name])
        model = gen.wrap_model(gen.build_model(cfg["model"]), c["policy"], c.get("use_orig_params", False), c.get("strategy", "FULL_SHARD"))
        optim = gen.make_optim(cfg["optim"], gen.optim_input(model, c["groups"], c["diff_inputs"], rank))
        fsdp_ckpt.write_desc(out, model, optim)
    finally:
        dist.destroy_process_group()


def fsdp2(rank, ws, port, out):
    """`tests/golden/fsdp2/gen.py`'s model, wrapped with `fully_shard` as it wraps it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    gen = golden_module("fsdp2/gen.py", "golden_fsdp2_gen")
    init(rank, ws, port)
    try:
        mesh = init_device_mesh("cpu", (ws,))
        torch.manual_seed(0)
        model = gen.Net()
        fully_shard(model.layers[0], mesh=mesh)
        fully_shard(model.layers[1], mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params={model.extra.step})
        optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
        fsdp_ckpt.write_desc(out, model, optim)
    finally:
        dist.destroy_process_group()


def not_a_parameter(rank, ws, port, out):
    """Rank 1's optimizer holds a tensor that is not the model's: every rank must raise."""
    gen = golden_module("gen.py", "golden_fsdp1_gen")
    init(rank, ws, port)
    try:
        model = gen.wrap_model(gen.build_model("tied"), "tied_layers_root", False, "FULL_SHARD")
        params = list(model.parameters())
        if rank == 1:
            params.append(torch.nn.Parameter(torch.zeros(3)))
        optim = torch.optim.SGD(params, lr=0.1)
        try:
            fsdp_ckpt.write_desc(out, model, optim)
            outcome = "returned"
        except Exception as e:  # what each rank saw
            outcome = f"{type(e).__name__}: {e}"
        with open(f"{out}.rank{rank}", "w") as f:
            f.write(outcome)
    finally:
        dist.destroy_process_group()


def fsdp_ckpt_model(rank, ws, port, use_orig, out):
    """`tests/golden/fsdp_ckpt_fixtures.py`'s model: FSDP(blocks.0), FSDP(blocks.2), the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    gen = golden_module("fsdp_ckpt_fixtures.py", "golden_fsdp_ckpt_fixtures")
    init(rank, ws, port)
    try:
        torch.manual_seed(0)
        model = gen.Model()
        kw = dict(device_id=torch.device("cpu"), use_orig_params=use_orig)
        model.blocks[0] = FSDP(model.blocks[0], **kw)
        model.blocks[2] = FSDP(model.blocks[2], **kw)
        model = FSDP(model, **kw)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        fsdp_ckpt.write_desc(out, model, optim)
    finally:
        dist.destroy_process_group()


def fsdp2_optim(rank, ws, port, name, out):
    """`tests/golden/fsdp2/gen_optim.py`'s model and optimizer `name`, FSDP2."""
    gen = golden_module("fsdp2/gen_optim.py", "golden_fsdp2_gen_optim")
    init(rank, ws, port)
    try:
        model = gen.wrapped(ws)
        optim = gen.make_optimizer(name, model)
        fsdp_ckpt.write_desc(out, model, optim)
    finally:
        dist.destroy_process_group()

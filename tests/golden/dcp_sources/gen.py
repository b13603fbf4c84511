"""DCP directories whose metadata is not one `.metadata` file, from REAL PyTorch 2.13, for
`tests/it/dcp_sources.rs` and `fsdp-ckpt/tests/cli_dcp_sources.rs`.

Run manually from the crate root with the project's venv, and commit the output:

    .venv/bin/python tests/golden/dcp_sources/gen.py            # every scenario
    .venv/bin/python tests/golden/dcp_sources/gen.py per_rank_ws3 hf_distributed  # some

Each scenario spawns `ws` ranks with `torch.multiprocessing` (gloo, 127.0.0.1, a free port)
and wraps a tiny model with FSDP2 `fully_shard` (`init_device_mesh("cpu", (ws,))`, the
linears first, then the root). It writes `tests/golden/dcp_sources/<scenario>/`:

* `per_rank_ws2`, `per_rank_ws3` — Adam, three steps, then
  `dcp.save({"model": msd, "optim": osd}, checkpoint_id="ckpt", use_collectives=False)` of
  `get_state_dict(model, optim)`: `ckpt/` holds `__{rank}.metadata` and `__{rank}_0.distcp`
  per rank and no `.metadata`. `expected.pt` is the saving run's
  `get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))` as
  `{"model": ..., "optim": ...}` (torch.save on rank 0), the dict a correct consolidation
  gives. `pytorch.txt` records what PyTorch's own `dcp_to_torch_save` makes of `ckpt/`: it
  finds no `.metadata`, falls back to `__0.metadata` and returns tensors whose other ranks'
  rows are whatever memory held (checked here: the result differs from `expected.pt`).
* `per_rank_disagree_step` (2 ranks) — as `per_rank_ws2`, but rank 1 saves a different
  `step` tensor for one parameter: the per-rank files disagree on a replicated item.
* `hf_rank0`, `hf_rank0_mapped` — `get_model_state_dict(full_state_dict=True)` saved by rank 0
  alone (`no_dist=True`) with `HuggingFaceStorageWriter(ckpt)` (one file
  `model-00001-of-00001.safetensors`) or with an `fqn_to_index_mapping` over two files;
  `model.safetensors.index.json` beside them.
* `hf_distributed`, `hf_distributed_mapped` — the sharded `get_model_state_dict` saved by
  every rank with `HuggingFaceStorageWriter(ckpt, save_distributed=True)` (and a mapping):
  `shard-{rank+1:05}-model-{i:05}-of-{N:05}.safetensors`, each header's
  `__metadata__.DCP_SHARDING_INFO` giving each tensor's offsets in the global tensor.
* `hf_consolidated` — as `hf_distributed_mapped` with `enable_consolidation=True`: the shards
  in `ckpt/sharded/`, PyTorch's merged files in `ckpt/`.

For every HF scenario `expected.pt` is PyTorch's own reading of the DCP data: `dcp.load`
into a plain dict (`_EmptyStateDictLoadPlanner`, as `dcp_to_torch_save` loads) with
`HuggingFaceStorageReader` (of `ckpt/sharded` for `hf_consolidated`), its keys in file-name
order, then by name within each file (PyTorch's order follows the directory listing, which is
not stable; within a file it is by name). It is checked here to equal the model's full
state dict, and for `hf_consolidated` to equal PyTorch's reading of the merged files too.

The model mixes row counts that split evenly and unevenly on 2 and 3 ranks, a one-row bias
(a zero-row chunk on the last ranks) and, for the HF scenarios, a bfloat16 layer.

`hostile/` holds `__{rank}.metadata` variants of `per_rank_ws3` (each
`<case>.__<rank>.metadata`, to put in a copy of that checkpoint): a chunk overlapping another
rank's, a key whose dtype or global shape disagrees with another rank's, a chunk missing (a
gap in the tiling), a non-tensor value that is a tensor on another rank, and rank 1's copy of
the replicated `lr` pointing at the bytes of `eps` (replicated values that differ).
"""

import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)

ROOT = Path(__file__).resolve().parent


class Net(nn.Module):
    """Linears of 6, 5 and 1 rows (even, uneven, fewer rows than ranks)."""

    def __init__(self, bf16: bool):
        super().__init__()
        self.fc1 = nn.Linear(3, 6)
        self.fc2 = nn.Linear(6, 5)
        self.out = nn.Linear(5, 1)
        if bf16:
            self.head = nn.Linear(2, 4, bias=False).to(torch.bfloat16)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x))))).sum()


SCENARIOS = {
    # name: (world size, kind)
    "per_rank_ws2": (2, "per_rank"),
    "per_rank_ws3": (3, "per_rank"),
    "per_rank_disagree_step": (2, "per_rank"),
    "hf_rank0": (2, "hf"),
    "hf_rank0_mapped": (2, "hf"),
    "hf_distributed": (2, "hf"),
    "hf_distributed_mapped": (2, "hf"),
    "hf_consolidated": (2, "hf"),
}

# Two files: the first linear and the bf16 head in file 1, the rest in file 2.
MAPPING = {
    "fc1.weight": 1,
    "fc1.bias": 1,
    "head.weight": 1,
    "fc2.weight": 2,
    "fc2.bias": 2,
    "out.weight": 2,
    "out.bias": 2,
}


def wrap(model, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    for m in (model.fc1, model.fc2, model.out):
        fully_shard(m, mesh=mesh)
    if hasattr(model, "head"):
        fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank, ws, port, name, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    torch.manual_seed(0)
    kind = SCENARIOS[name][1]
    model = wrap(Net(bf16=kind == "hf"), ws)
    os.chdir(out)
    if kind == "per_rank":
        save_per_rank(rank, model, name, out)
    else:
        save_hf(rank, model, name, out)
    dist.barrier()
    if rank == 0:
        (out / "done").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


def save_per_rank(rank, model, name, out):
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step * 10 + rank)
        optim.zero_grad()
        model(torch.randn(4, 3, generator=g)).backward()
        optim.step()
    msd, osd = get_state_dict(model, optim)
    if rank == 1 and name == "per_rank_disagree_step":
        osd["state"]["fc2.bias"]["step"] = osd["state"]["fc2.bias"]["step"] + 1
    dcp.save({"model": msd, "optim": osd}, checkpoint_id="ckpt", use_collectives=False)
    full_msd, full_osd = get_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True)
    )
    if rank == 0:
        torch.save({"model": full_msd, "optim": full_osd}, out / "expected.pt")


def save_hf(rank, model, name, out):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    mapping = MAPPING if name != "hf_rank0" and name != "hf_distributed" else None
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save(full, out / "model.pt")
    if name.startswith("hf_rank0"):
        if rank == 0:
            writer = HuggingFaceStorageWriter("ckpt", fqn_to_index_mapping=mapping)
            dcp.save(full, storage_writer=writer, no_dist=True)
        return
    msd = get_model_state_dict(model)
    writer = HuggingFaceStorageWriter(
        "ckpt",
        fqn_to_index_mapping=mapping,
        save_distributed=True,
        enable_consolidation=name == "hf_consolidated",
    )
    dcp.save(msd, storage_writer=writer)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name):
    ws = SCENARIOS[name][0]
    out = ROOT / name
    for attempt in range(4):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        try:
            mp.spawn(worker, args=(ws, free_port(), name, out), nprocs=ws, join=True)
        except Exception as e:  # gloo sometimes aborts a process at exit after the work
            print(f"{name}: attempt {attempt} raised {e!r}", file=sys.stderr)
        if (out / "done").exists():
            break
    else:
        raise SystemExit(f"{name}: no complete checkpoint after 4 attempts")
    (out / "done").unlink()
    if SCENARIOS[name][1] == "per_rank":
        if name in ("per_rank_ws2", "per_rank_ws3"):
            record_pytorch_per_rank(out)
    else:
        record_pytorch_hf(name, out)
    print(f"{name}: ok")


def record_pytorch_per_rank(out):
    """What `dcp_to_torch_save` makes of a per-rank directory, into `pytorch.txt`."""
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    logging.getLogger().addHandler(handler)  # state_dict_loader logs to the root logger
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(out / "ckpt", Path(tmp) / "got.pt")
        got = torch.load(Path(tmp) / "got.pt", weights_only=False)
    logging.getLogger().removeHandler(handler)
    want = torch.load(out / "expected.pt", weights_only=False)
    differing = []

    def walk(a, b, path):
        if isinstance(a, torch.Tensor):
            if not (a.shape == b.shape and torch.equal(
                a.contiguous().flatten().view(torch.uint8),
                b.contiguous().flatten().view(torch.uint8),
            )):
                differing.append(path)
        elif isinstance(a, dict):
            for k in a:
                walk(a[k], b[k], f"{path}.{k}" if path else str(k))
        elif isinstance(a, (list, tuple)):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}.{i}")

    walk(want, got, "")
    if not differing:
        raise SystemExit(f"{out.name}: dcp_to_torch_save gave the right result after all")
    warned = [
        r.getMessage().replace(str(ROOT) + "/", "") + (
            f" ({r.exc_info[0].__name__}: {r.exc_info[1]})".replace(str(ROOT) + "/", "")
            if r.exc_info
            else ""
        )
        for r in records
        if r.levelno >= logging.WARNING
    ]
    (out / "pytorch.txt").write_text(
        "torch " + torch.__version__.split("+")[0] + ": "
        "format_utils.dcp_to_torch_save(ckpt, out.pt) on this directory\n"
        "warned: " + " | ".join(warned) + "\n"
        "and returned tensors differing from expected.pt (rows of ranks other than 0 are "
        "uninitialised memory) at:\n" + "".join(f"  {p}\n" for p in differing)
    )


def hf_load(ckpt):
    """PyTorch's reading of an HF-storage directory: `dcp.load` into a plain dict (its private
    `_load_state_dict`, as `dcp_to_torch_save` calls it: `dcp.load` keeps only the keys the
    dict already had)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {}
    _load_state_dict(
        sd,
        storage_reader=HuggingFaceStorageReader(str(ckpt)),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    # PyTorch orders keys by `Path.iterdir()` (not stable), then by name within each file
    # (`safe_open(...).keys()`); the files taken in name order instead, that is the crate's.
    from safetensors import safe_open

    order = []
    for f in sorted(p for p in Path(ckpt).iterdir() if p.name.endswith(".safetensors")):
        with safe_open(str(f), framework="pt") as h:
            order += [k for k in h.keys() if k not in order]
    assert sorted(order) == sorted(sd)
    return {k: sd[k] for k in order}


def same_tensors(a, b):
    def raw(t):
        return t.detach().contiguous().flatten().view(torch.uint8)

    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k]))
        for k in a
    )


def record_pytorch_hf(name, out):
    ckpt = out / "ckpt"
    dcp_dir = ckpt / "sharded" if name == "hf_consolidated" else ckpt
    got = hf_load(dcp_dir)
    model = torch.load(out / "model.pt", weights_only=True)
    if not same_tensors(got, model):
        raise SystemExit(f"{name}: PyTorch's load differs from the model's full state dict")
    if name == "hf_consolidated" and not same_tensors(hf_load(ckpt), model):
        raise SystemExit(f"{name}: PyTorch's reading of the merged files differs")
    torch.save(got, out / "expected.pt")
    (out / "model.pt").unlink()


def hostile(base="per_rank_ws3"):
    """`__{rank}.metadata` variants of `base` that a merge must refuse."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    out = ROOT / "hostile"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    key = "model.fc1.weight"

    def variant(case, rank, edit):
        with open(ROOT / base / "ckpt" / f"__{rank}.metadata", "rb") as f:
            md = pickle.load(f)
        edit(md)
        with open(out / f"{case}.__{rank}.metadata", "wb") as f:
            pickle.dump(md, f)

    def overlap(md):
        # Rank 1's chunk claims to start one row earlier, over rank 0's last row.
        tmd = md.state_dict_metadata[key]
        c = tmd.chunks[0]
        old = next(k for k in md.storage_data if k.fqn == key)
        info = md.storage_data.pop(old)
        moved = torch.Size([c.offsets[0] - 1] + list(c.offsets[1:]))
        tmd.chunks[0] = ChunkStorageMetadata(offsets=moved, sizes=c.sizes)
        md.storage_data[type(old)(key, moved, old.index)] = info

    def wrong_dtype(md):
        md.state_dict_metadata[key].properties.dtype = torch.float64

    def wrong_size(md):
        tmd = md.state_dict_metadata[key]
        tmd.size = torch.Size([tmd.size[0] + 1] + list(tmd.size[1:]))

    def missing_chunk(md):
        # Rank 1 no longer lists its chunk of fc1.weight: rows 2..4 are held by no rank.
        md.state_dict_metadata[key].chunks.clear()

    def bytes_as_tensor(md):
        # A non-tensor value on rank 0 is a tensor on rank 2.
        src = md.state_dict_metadata[key]
        k = "optim.param_groups.0.lr"
        md.state_dict_metadata[k] = type(src)(src.properties, src.size, [])

    def lr_differs(md):
        lr = next(k for k in md.storage_data if k.fqn == "optim.param_groups.0.lr")
        eps = next(k for k in md.storage_data if k.fqn == "optim.param_groups.0.eps")
        md.storage_data[lr] = md.storage_data[eps]

    variant("lr_differs", 1, lr_differs)
    variant("overlap", 1, overlap)
    variant("wrong_dtype", 2, wrong_dtype)
    variant("wrong_size", 2, wrong_size)
    variant("missing_chunk", 1, missing_chunk)
    variant("bytes_as_tensor", 2, bytes_as_tensor)
    print("hostile: ok")


def main():
    names = sys.argv[1:] or list(SCENARIOS)
    if names == ["hostile"]:
        hostile()
        return
    for name in names:
        run(name)
    if "per_rank_ws3" in names:
        hostile()


if __name__ == "__main__":
    main()

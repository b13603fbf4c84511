"""DCP fixtures from REAL PyTorch 2.13 for `tests/it/dcp.rs`.

Run manually from the crate root with the project's venv, and commit the output:

    .venv/bin/python tests/golden/dcp/gen.py               # every scenario
    .venv/bin/python tests/golden/dcp/gen.py fsdp2_adam_ws4 # only the named scenarios
    .venv/bin/python tests/golden/dcp/gen.py hostile        # only the hostile variants

Each scenario spawns `ws` ranks with `torch.multiprocessing` (gloo, 127.0.0.1, a free port),
wraps a tiny model with FSDP2 `fully_shard` (`init_device_mesh("cpu", (ws,))`, innermost
modules first, then the root) or FSDP1 (`use_orig_params` True or False, sharded state dict),
trains it a few steps, and saves `get_state_dict(model, optim)` with
`dcp.save({"model": ..., "optim": ...}, checkpoint_id=ckpt)`. It writes
`tests/golden/dcp/<scenario>/`:

* `ckpt/` — the DCP directory (`.metadata`, `__{rank}_0.distcp`);
* `expected.pt` — `format_utils.dcp_to_torch_save(ckpt, expected.pt)`.

Coverage: uneven dim-0 splits (10 rows on 3 or 4 ranks), tensors with fewer rows than ranks
(3 rows on 4 ranks: an empty chunk), tied embeddings, frozen parameters, two param groups,
Adam with amsgrad, AdamW, SGD with momentum.

It also writes `tests/golden/dcp/hostile/` from the `fsdp2_adam_ws4` checkpoint: `.metadata`
variants (each `<case>.metadata`, to put in a copy of that checkpoint) whose storage data point
outside the directory, past a file's end, at overlapping or missing chunks, or whose chunk
metadata disagree with the chunks, whose `planner_data` paths are not their keys' own (two keys
sharing one path, a path through another key's value, a `param_groups` list with a gap), and
`exploit.metadata`, a pickle whose loading would run a
shell command (it must be refused, never run).

And `tests/golden/dcp/pytorch_reads/`: `.metadata` variants that `dcp.save` does not write but
that `dcp_to_torch_save` reads back exactly as the original (checked when they are written):
each `<case>.metadata`, with `<case>.base` naming the scenario whose `ckpt/` it belongs in and
whose `expected.pt` it must give.
"""

import os
import pickle
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

ROOT = Path(__file__).resolve().parent


class Net(nn.Module):
    """Embedding (10 rows, optionally tied to the head), two linears (10 and 3 rows)."""

    def __init__(self, tied: bool, frozen: bool):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.net1 = nn.Sequential(nn.Linear(4, 10), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(10, 3))
        self.head = nn.Linear(3, 10, bias=False)
        # head.weight is (10, 3); tying it to a (10, 4) embedding is impossible, so the tied
        # variant ties the embedding to a separate (10, 4) output projection instead.
        self.out = nn.Linear(4, 10, bias=False)
        if tied:
            self.out.weight = self.embed.weight
        if frozen:
            for p in self.net2.parameters():
                p.requires_grad_(False)

    def forward(self, idx):
        x = self.embed(idx)
        h = self.net2(self.net1(x))
        return self.head(h).sum() + self.out(x).sum()


SCENARIOS = {
    # name: (world size, wrapper, optimizer, tied, frozen, two param groups)
    "fsdp2_adam_ws4": (4, "fsdp2", "adam_amsgrad", False, False, False),
    "fsdp2_adamw_ws3_tied": (3, "fsdp2", "adamw", True, False, True),
    "fsdp2_sgd_ws2_frozen": (2, "fsdp2", "sgd_momentum", False, True, False),
    "fsdp1_orig_ws3": (3, "fsdp1_orig", "adamw", False, True, False),
    "fsdp1_flat_ws4": (4, "fsdp1_flat", "adam_amsgrad", True, False, False),
    # A 2-D grid of chunks (DTensor on a 2x2 mesh, Shard(0) and Shard(1)), int dict keys,
    # lists mixing tensors and plain values, bf16 and int64 tensors.
    "dtensor_grid_ws4": (4, "grid", None, False, False, False),
}


def make_optim(kind, model, two_groups):
    params = [p for p in model.parameters() if p.requires_grad]
    if two_groups:
        first = [p for n, p in model.named_parameters() if p.requires_grad and "net1" in n]
        ids = {id(p) for p in first}
        rest = [p for p in params if id(p) not in ids]
        groups = [{"params": first, "lr": 0.02}, {"params": rest}]
    else:
        groups = [{"params": params}]
    if kind == "adam_amsgrad":
        return torch.optim.Adam(groups, lr=0.01, amsgrad=True)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    if kind == "sgd_momentum":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    raise ValueError(kind)


def wrap(kind, model, ws):
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ws,))
        for m in (model.net1, model.net2):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
        use_orig_params=kind == "fsdp1_orig",
        device_id=torch.device("cpu"),
    )


def worker(rank, ws, port, name, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    _, kind, optim_kind, tied, frozen, two_groups = SCENARIOS[name]
    torch.manual_seed(0)
    if kind == "grid":
        save_grid(rank, ws, out)
        return
    model = wrap(kind, Net(tied, frozen), ws)
    optim = make_optim(optim_kind, model, two_groups)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step * 10 + rank)
        idx = torch.randint(0, 10, (5,), generator=g)
        optim.zero_grad()
        model(idx).backward()
        optim.step()
    msd, osd = get_state_dict(model, optim)
    # A relative checkpoint_id, so that no machine path is recorded in `.metadata`.
    os.chdir(out)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id="ckpt")
    dist.barrier()
    if rank == 0:
        (out / "done").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


def save_grid(rank, ws, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, ws // 2))
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5) / 7
    grid = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    cube = distribute_tensor(
        torch.arange(3 * 4 * 2, dtype=torch.bfloat16).reshape(3, 4, 2), mesh, [Shard(1), Shard(2)]
    )
    state = {
        "model": {"grid": grid, "cube": cube},
        "extra": {
            0: torch.tensor([1, 2, 3], dtype=torch.int64),
            "mixed": [torch.ones(2), 3, "s", None, (1.5, 2)],
            "scalar": 0.25,
        },
    }
    os.chdir(out)
    dcp.save(state, checkpoint_id="ckpt")
    dist.barrier()
    if rank == 0:
        (out / "done").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


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
        if (out / "done").exists() and (out / "ckpt" / ".metadata").exists():
            break
    else:
        raise SystemExit(f"{name}: no complete checkpoint after 4 attempts")
    (out / "done").unlink()
    dcp_to_torch_save(out / "ckpt", out / "expected.pt")
    print(f"{name}: ok")


def hostile(base):
    """`.metadata` variants of `base`'s checkpoint that a reader must refuse."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    out = ROOT / "hostile"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    md_path = ROOT / base / "ckpt" / ".metadata"

    def variant(case, edit):
        with open(md_path, "rb") as f:
            md = pickle.load(f)
        edit(md)
        with open(out / f"{case}.metadata", "wb") as f:
            pickle.dump(md, f)

    key = "model.net1.0.weight"

    def first_storage(md, fqn=key):
        return next(k for k in md.storage_data if k.fqn == fqn)

    def set_path(path):
        def edit(md):
            md.storage_data[first_storage(md)].relative_path = path

        return edit

    def past_eof(md):
        info = md.storage_data[first_storage(md)]
        info.offset = 1 << 40

    def long_length(md):
        info = md.storage_data[first_storage(md)]
        info.length = 1 << 40

    def overlap(md):
        # Chunk 1 claims to start where chunk 0 does.
        tmd = md.state_dict_metadata[key]
        c1 = tmd.chunks[1]
        old = next(k for k in md.storage_data if k.fqn == key and k.offset == c1.offsets)
        info = md.storage_data.pop(old)
        tmd.chunks[1] = ChunkStorageMetadata(offsets=tmd.chunks[0].offsets, sizes=c1.sizes)
        new = type(old)(key, tmd.chunks[0].offsets, old.index)
        md.storage_data[new] = info

    def missing_chunk(md):
        tmd = md.state_dict_metadata[key]
        tmd.chunks.pop(1)

    def missing_storage(md):
        md.storage_data.pop(first_storage(md))

    def wrong_dtype(md):
        md.state_dict_metadata[key].properties.dtype = torch.float64

    def wrong_shape(md):
        # Chunk sizes disagree with the stored chunk (one column fewer) but still cover
        # a smaller global shape exactly.
        tmd = md.state_dict_metadata[key]
        tmd.size = torch.Size([tmd.size[0], tmd.size[1] - 1])
        for c in tmd.chunks:
            c.sizes = torch.Size([c.sizes[0], c.sizes[1] - 1])

    variant("escape_parent", set_path("../outside.distcp"))
    variant("escape_absolute", set_path("/etc/passwd"))
    variant("escape_symlink", set_path("link/__0_0.distcp"))
    variant("missing_file", set_path("__9_0.distcp"))
    variant("past_eof", past_eof)
    variant("long_length", long_length)
    variant("overlap", overlap)
    variant("missing_chunk", missing_chunk)
    variant("missing_storage", missing_storage)
    variant("wrong_dtype", wrong_dtype)
    variant("wrong_shape", wrong_shape)

    # planner_data: each path must be its key's own path (the key is the path joined with
    # "."), as PyTorch's loader checks by flattening the rebuilt dict again.
    def shared_path(md):
        # Two keys, one path: PyTorch's dcp_to_torch_save silently drops `eps`.
        pd = md.planner_data
        pd["optim.param_groups.0.eps"] = pd["optim.param_groups.0.lr"]

    def path_not_key(md):
        md.planner_data[key] = ("model", "net9", "0", "weight")

    def path_through_value(md):
        # A value placed inside another key's tensor.
        md.planner_data["optim.param_groups.0.lr"] = tuple(md.planner_data[key]) + ("lr",)

    def param_groups_gap(md):
        # The only param group saved as group 2: lists with holes (`[None, None, {...}]`).
        def renamed(k):
            return k.replace("optim.param_groups.0.", "optim.param_groups.2.", 1)

        sdm = md.state_dict_metadata
        md.state_dict_metadata = {renamed(k): v for k, v in sdm.items()}
        md.planner_data = {
            renamed(k): tuple(2 if (i == 2 and k.startswith("optim.param_groups.0.")) else p
                              for i, p in enumerate(path))
            for k, path in md.planner_data.items()
        }
        md.storage_data = {
            type(i)(renamed(i.fqn), i.offset, i.index): v for i, v in md.storage_data.items()
        }

    def storage_meta_int(md):
        # PyTorch's reader sets `storage_meta.load_id`: an int takes no attribute.
        md.storage_meta = 5

    variant("storage_meta_int", storage_meta_int)
    variant("shared_path", shared_path)
    variant("path_not_key", path_not_key)
    variant("path_through_value", path_through_value)
    variant("param_groups_gap", param_groups_gap)

    def unknown_layout(data):
        # A layout name `torch.serialization._get_layout` does not know (a KeyError there).
        return data.replace(b"torch.strided", b"torch.st0ided")

    with open(md_path, "rb") as f:
        (out / "unknown_layout.metadata").write_bytes(unknown_layout(f.read()))

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch /tmp/fsdp-dcp-exploit-ran",))

    with open(out / "exploit.metadata", "wb") as f:
        pickle.dump(Exploit(), f)
    print("hostile: ok")


def pytorch_reads():
    """`.metadata` variants that are not what `dcp.save` writes but that PyTorch's
    `dcp_to_torch_save` reads back exactly as the original: each `<case>.metadata`, to put in
    a copy of `<base>/ckpt`, must give `<base>/expected.pt` (checked here)."""
    import tempfile

    out = ROOT / "pytorch_reads"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()

    def plain_list_named(md):
        # `amsgrad`'s path one step deeper: PyTorch reads the list `[placeholder]` as one
        # value named `optim.param_groups.0.amsgrad` and loads that key there.
        pd = md.planner_data
        pd["optim.param_groups.0.amsgrad"] = tuple(pd["optim.param_groups.0.amsgrad"]) + (0,)

    def gap_named(md):
        # `mixed.2` moved onto `mixed.4`'s slot: the gap at index 2 is named `mixed.2`.
        md.planner_data["extra.mixed.2"] = ("extra", "mixed", 4)

    def negative_index(md):
        # `mixed.2` at `-1` overwrites `mixed.1`'s slot (named `mixed.1`); the gap it leaves
        # is named `mixed.2`.
        md.planner_data["extra.mixed.2"] = ("extra", "mixed", -1)

    def flattened_as_2_3(md):
        # `extra.scalar` one step deeper under a string: the place `extra.scalar.x` is no key,
        # so the loader falls back to PyTorch 2.3's traversal, which reads the plain dict
        # `{'x': placeholder}` as one value named `extra.scalar`.
        md.planner_data["extra.scalar"] = ("extra", "scalar", "x")

    def storage_meta_other_instance(md):
        # The reader only sets `load_id` on it, which any dataclass instance takes.
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md.storage_meta = BytesStorageMetadata()

    def unused_planner_entries(md):
        # Paths are looked up only by the keys of state_dict_metadata: others never matter.
        md.planner_data[torch.Size([])] = 5
        md.planner_data["no.such.key"] = ("a", 1.5)

    def root_other_class(md):
        # The reader reads the root's attributes only: an instance of another DCP dataclass
        # holding Metadata's attributes reads the same.
        from torch.distributed.checkpoint.metadata import StorageMeta

        other = StorageMeta()
        other.__dict__.clear()
        other.__dict__.update(md.__dict__)
        return other

    def chunk_other_class(md):
        # A chunk is read by its `offsets` and `sizes` only.
        from torch.distributed.checkpoint.metadata import StorageMeta

        tmd = md.state_dict_metadata["model.net1.0.weight"]
        other = StorageMeta()
        other.__dict__.clear()
        other.__dict__.update(tmd.chunks[0].__dict__)
        tmd.chunks[0] = other

    def unread_records_malformed(md):
        # The empty chunks of a tensor with fewer rows than ranks are never read: one with a
        # negative size and a malformed storage record, one whose record's key has a
        # negative offset.
        bias = md.state_dict_metadata["model.net2.0.bias"]
        empty = next(c for c in bias.chunks if c.sizes[0] == 0)
        empty.sizes = torch.Size([-1])
        key = next(k for k in md.storage_data
                   if k.fqn == "model.net2.0.bias" and k.offset == empty.offsets)
        md.storage_data[key].length = -7
        md.storage_data[key].relative_path = 42
        weight = md.state_dict_metadata["model.net2.0.weight"]
        empty = next(c for c in weight.chunks if c.sizes[0] == 0)
        key = next(k for k in md.storage_data
                   if k.fqn == "model.net2.0.weight" and k.offset == empty.offsets)
        info = md.storage_data.pop(key)
        md.storage_data[type(key)(key.fqn, torch.Size([-1, 0]), key.index)] = info

    cases = {
        "plain_list_named": ("fsdp2_adam_ws4", plain_list_named),
        "gap_named": ("dtensor_grid_ws4", gap_named),
        "negative_index": ("dtensor_grid_ws4", negative_index),
        "flattened_as_2_3": ("dtensor_grid_ws4", flattened_as_2_3),
        "storage_meta_other_instance": ("fsdp2_adam_ws4", storage_meta_other_instance),
        "unused_planner_entries": ("fsdp2_adam_ws4", unused_planner_entries),
        "root_other_class": ("fsdp2_adam_ws4", root_other_class),
        "chunk_other_class": ("fsdp2_adam_ws4", chunk_other_class),
        "unread_records_malformed": ("fsdp2_adam_ws4", unread_records_malformed),
    }
    for case, (base, edit) in cases.items():
        with open(ROOT / base / "ckpt" / ".metadata", "rb") as f:
            md = pickle.load(f)
        md = edit(md) or md
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / "ckpt"
            shutil.copytree(ROOT / base / "ckpt", ckpt)
            with open(ckpt / ".metadata", "wb") as f:
                pickle.dump(md, f)
            dcp_to_torch_save(ckpt, Path(tmp) / "got.pt")
            got = torch.load(Path(tmp) / "got.pt", weights_only=False)
        want = torch.load(ROOT / base / "expected.pt", weights_only=False)
        if not same(got, want):
            raise SystemExit(f"pytorch_reads/{case}: PyTorch's result differs from {base}")
        with open(out / f"{case}.metadata", "wb") as f:
            pickle.dump(md, f)
        (out / f"{case}.base").write_text(base + "\n")
    print("pytorch_reads: ok")


def same(a, b):
    """Equal values of equal types, tensors bit for bit, dicts in the same order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        def raw(t):
            return t.detach().contiguous().flatten().view(torch.uint8)

        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def main():
    names = sys.argv[1:] or list(SCENARIOS)
    if names == ["hostile"]:
        # Only the hostile and pytorch_reads variants, from the checked-in checkpoints.
        hostile("fsdp2_adam_ws4")
        pytorch_reads()
        return
    for name in names:
        run(name)
    if "fsdp2_adam_ws4" in names:
        hostile("fsdp2_adam_ws4")
        pytorch_reads()


if __name__ == "__main__":
    main()

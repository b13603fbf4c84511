"""DCP directories in every form `FileSystemWriter` writes, from REAL PyTorch 2.13, for
`tests/it/dcp_forms.rs` and `fsdp-ckpt/tests/cli_dcp.rs`.

Run manually from the crate root with the project's venv (it needs `zstandard`), and commit
the output:

    .venv/bin/python tests/golden/dcp_forms/gen.py            # every scenario + hostile
    .venv/bin/python tests/golden/dcp_forms/gen.py zstd_ws3   # only the named scenarios
    .venv/bin/python tests/golden/dcp_forms/gen.py hostile    # only the hostile variants

Each scenario spawns `ws` gloo ranks on CPU, wraps `tests/golden/dcp/gen.py`'s `Net` with
FSDP2 `fully_shard` (net1, net2, then the root), trains it three steps with Adam, and saves
`get_state_dict(model, optim)` with `dcp.save({"model": ..., "optim": ...},
storage_writer=FileSystemWriter("ckpt", ...))` under one writer option. It writes
`tests/golden/dcp_forms/<scenario>/`:

* `ckpt/` — the DCP directory;
* `expected.pt` — `format_utils.dcp_to_torch_save(ckpt, expected.pt)`, where PyTorch can;
* `pytorch.txt` — for `safetensors_ws2`, which PyTorch cannot read back: what its
  `dcp_to_torch_save` and `dcp.load` raise (checked here to fail).

Scenarios: `zstd_ws3` (`_extensions=[ZStandard()]`: every item a zstd frame,
`transform_descriptors == ["stream.zstd/1"]`), `per_item_ws2` (`single_file_per_rank=False`:
one file per item), `threads_ws3` (`thread_count=2`: two files per rank), `safetensors_ws2`
(`serialization_format=SerializationFormat.SAFETENSORS`), `local_plans_ws2` (default writer, a
planner that keeps every rank's `SavePlan` in `Metadata.all_local_plans`, as Megatron-Core's
`torch_dist` does).

And `tests/golden/dcp_forms/hostile/`, for copies of `zstd_ws3/ckpt`: `bomb.distcp`, zstd
frames of zeros that expand past what their items may hold (a tensor chunk: 4 MiB; a
non-tensor value: 80 MiB, from a few KB each), with `tensor_bomb.metadata` and
`bytes_bomb.metadata` pointing an item at them; `unknown_transform.metadata` (a descriptor
no registry knows, `stream.lz4/1`) and `zstd_v2.metadata` (`stream.zstd/2`), both of which
PyTorch's `dcp_to_torch_save` refuses (checked here).
"""

import io
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
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "dcp"))
from gen import Net, wrap  # noqa: E402

SCENARIOS = {
    # name: (world size, FileSystemWriter keyword arguments)
    "zstd_ws3": (3, lambda: {"_extensions": [ZStandard()]}),
    "per_item_ws2": (2, lambda: {"single_file_per_rank": False}),
    "threads_ws3": (3, lambda: {"thread_count": 2}),
    "safetensors_ws2": (2, lambda: {"serialization_format": SerializationFormat.SAFETENSORS}),
    "local_plans_ws2": (2, lambda: {}),
}


class KeepLocalPlans(DefaultSavePlanner):
    """What Megatron-Core's `torch_dist` save planner does: every rank's local `SavePlan`
    (its `WriteItem`s, with `TensorWriteData` / `BytesIOWriteData`, `WriteItemType`,
    `ChunkStorageMetadata`, `TensorProperties`, `MetadataIndex`) kept in the global
    `Metadata` as the attribute `all_local_plans`, which `dcp.load` never looks at."""

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        metadata.all_local_plans = all_plans
        return plans, metadata


PLANNERS = {"local_plans_ws2": KeepLocalPlans}


def worker(rank, ws, port, name, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    torch.manual_seed(0)
    model = wrap("fsdp2", Net(False, False), ws)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step * 10 + rank)
        idx = torch.randint(0, 10, (5,), generator=g)
        optim.zero_grad()
        model(idx).backward()
        optim.step()
    msd, osd = get_state_dict(model, optim)
    # A relative path, so that no machine path is recorded in `.metadata`.
    os.chdir(out)
    writer = FileSystemWriter("ckpt", **SCENARIOS[name][1]())
    planner = PLANNERS[name]() if name in PLANNERS else None
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer, planner=planner)
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
    if name == "safetensors_ws2":
        (out / "pytorch.txt").write_text(pytorch_fails_on(out / "ckpt"))
    else:
        dcp_to_torch_save(out / "ckpt", out / "expected.pt")
    print(f"{name}: ok")


def pytorch_fails_on(ckpt):
    """What PyTorch 2.13 raises reading `ckpt` back (it must raise)."""
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dcp_to_torch_save(ckpt, Path(tmp) / "out.pt")
        except CheckpointException as e:  # a BaseException naming the rank's error
            lines.append(f"dcp_to_torch_save: {type(e).__name__}: {last_line(e)}")
        else:
            raise SystemExit(f"{ckpt}: PyTorch's dcp_to_torch_save read it")
    md = dcp.FileSystemReader(ckpt).read_metadata()
    key = next(k for k, v in md.state_dict_metadata.items() if hasattr(v, "size"))
    v = md.state_dict_metadata[key]
    target = {key: torch.zeros(v.size, dtype=v.properties.dtype)}
    try:
        dcp.load(target, checkpoint_id=ckpt, no_dist=True)
    except CheckpointException as e:
        lines.append(f"dcp.load of {key}: {type(e).__name__}: {last_line(e)}")
    else:
        raise SystemExit(f"{ckpt}: PyTorch's dcp.load read {key}")
    return "\n".join(lines) + "\n"


def last_line(e):
    """The last line of an exception's message: the rank's own error in a CheckpointException."""
    return str(e).strip().splitlines()[-1]


def hostile(base):
    """Variants of `base`'s compressed checkpoint that a reader must refuse."""
    import zstandard

    out = ROOT / "hostile"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    ckpt = ROOT / base / "ckpt"
    def storage(md, fqn):
        return next(v for k, v in md.storage_data.items() if k.fqn == fqn)

    def variant(case, edit):
        with open(ckpt / ".metadata", "rb") as f:
            md = pickle.load(f)
        edit(md)
        with open(out / f"{case}.metadata", "wb") as f:
            pickle.dump(md, f)
        return md

    # Zeros compress to almost nothing: a few KB that expand to 4 MiB and 80 MiB.
    compress = zstandard.ZstdCompressor().compress
    tensor_bomb = compress(bytes(4 << 20))
    bytes_bomb = compress(bytes(80 << 20))
    (out / "bomb.distcp").write_bytes(tensor_bomb + bytes_bomb)

    def point(fqn, offset, length):
        def edit(md):
            info = storage(md, fqn)
            info.relative_path = "bomb.distcp"
            info.offset = offset
            info.length = length
            info.transform_descriptors = ["stream.zstd/1"]

        return edit

    variant("tensor_bomb", point("model.net1.0.weight", 0, len(tensor_bomb)))
    variant("bytes_bomb", point("optim.param_groups.0.lr", len(tensor_bomb), len(bytes_bomb)))

    def descriptors(fqn, descs):
        def edit(md):
            storage(md, fqn).transform_descriptors = descs

        return edit

    for case, descs in [("unknown_transform", ["stream.lz4/1"]), ("zstd_v2", ["stream.zstd/2"])]:
        variant(case, descriptors("model.net1.0.weight", descs))
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "ckpt"
            shutil.copytree(ckpt, copy)
            shutil.copy(out / f"{case}.metadata", copy / ".metadata")
            try:
                dcp_to_torch_save(copy, Path(tmp) / "out.pt")
            except CheckpointException as e:  # wrapping the ValueError
                if "Unknown extension" not in str(e):
                    raise
                print(f"hostile/{case}: PyTorch refuses it (Unknown extension)")
            else:
                raise SystemExit(f"hostile/{case}: PyTorch read it")
    huge_declared(ckpt, out, variant)
    trailing_frames(ckpt, out, variant, storage)
    print("hostile: ok")


def huge_declared(ckpt, out, variant):
    """`huge_declared.metadata`: `model.net2.0.bias` declared [2**34] float32 (64 GiB) in one
    chunk, stored in its first chunk's compressed item (a few hundred bytes, which cannot
    decompress to 64 GiB). PyTorch is not run on it: its loader allocates the declared size."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    def edit(md):
        key = "model.net2.0.bias"
        smd = md.state_dict_metadata[key]
        smd.size = torch.Size([2**34])
        smd.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2**34]))]
        first = next(k for k in md.storage_data if k.fqn == key and list(k.offset) == [0])
        info = md.storage_data.pop(first)
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
        md.storage_data[MetadataIndex(key, torch.Size([0]), 0)] = info

    variant("huge_declared", edit)


# What each `trailing_<case>.metadata` puts in `model.net1.0.weight`'s first chunk's range (in
# `frames.distcp`), from that item's frame F and archive A, and whether PyTorch 2.13 with
# `zstandard` loads it (its stream reader reads every frame and passes over a cut one;
# `torch.load` reads the last end record it finds and ignores bytes after the archive).
TRAILING = {
    "garbage": (lambda f, a, c: f + b"garbage!", False),
    "second_frame": (lambda f, a, c: f + c(a), True),
    "hello_frame": (lambda f, a, c: f + c(b"hello"), True),
    "cut_frame": (lambda f, a, c: f + c(a)[:5], True),
    "gib_frame": (lambda f, a, c: f + rle_frame(1 << 30), None),
    "split": (lambda f, a, c: c(a[:500]) + c(a[500:]), True),
    "skippable": (lambda f, a, c: f + b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd",
                  True),
}


def rle_frame(size):
    """A zstd frame of `size` zero bytes (a multiple of 128 KiB) in RLE blocks of 128 KiB: 4
    stored bytes per block, the most any zstd block gives."""
    out = b"\x28\xb5\x2f\xfd" + bytes([0x00, 13 << 3])  # magic, descriptor, 8 MiB window
    blocks = size // (128 << 10)
    for i in range(blocks):
        last = 1 if i == blocks - 1 else 0
        out += (last | 1 << 1 | (128 << 10) << 3).to_bytes(3, "little") + b"\x00"
    return out


def trailing_frames(ckpt, out, variant, storage):
    """`frames.distcp` and a `trailing_<case>.metadata` per case of [`TRAILING`], each checked
    against PyTorch (not `gib_frame`: PyTorch reads its gibibyte into memory)."""
    import zstandard

    with open(ckpt / ".metadata", "rb") as f:
        info = storage(pickle.load(f), "model.net1.0.weight")
    frame = (ckpt / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    archive = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frame)).read(-1)
    compress = zstandard.ZstdCompressor().compress
    data, at = b"", {}
    for case, (make, _) in TRAILING.items():
        item = make(frame, archive, compress)
        at[case] = (len(data), len(item))
        data += item
    (out / "frames.distcp").write_bytes(data)
    for case, (_, loads) in TRAILING.items():
        def edit(md, case=case):
            info = storage(md, "model.net1.0.weight")
            info.relative_path = "frames.distcp"
            info.offset, info.length = at[case]

        variant(f"trailing_{case}", edit)
        if case == "second_frame":
            # The same in an optimizer state's item (what `convert --to fsdp` reads).
            def edit_optim(md):
                info = storage(md, "optim.state.net1.0.weight.exp_avg")
                info.relative_path = "frames.distcp"
                info.offset, info.length = at["second_frame"]

            variant("trailing_second_frame_optim", edit_optim)
        if loads is None:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "ckpt"
            shutil.copytree(ckpt, copy)
            shutil.copy(out / "frames.distcp", copy)
            shutil.copy(out / f"trailing_{case}.metadata", copy / ".metadata")
            try:
                dcp_to_torch_save(copy, Path(tmp) / "out.pt")
                got = torch.load(Path(tmp) / "out.pt")["model"]["net1.0.weight"]
                want = torch.load(ROOT / "zstd_ws3" / "expected.pt")["model"]["net1.0.weight"]
                read = bool(torch.equal(got, want))
            except CheckpointException:
                read = False
            if read != loads:
                raise SystemExit(f"hostile/trailing_{case}: PyTorch loads it: {read}")
            print(f"hostile/trailing_{case}: PyTorch {'loads' if read else 'refuses'} it")


def main():
    names = sys.argv[1:] or list(SCENARIOS)
    if names != ["hostile"]:
        for name in names:
            run(name)
    if names == ["hostile"] or "zstd_ws3" in names:
        hostile("zstd_ws3")


if __name__ == "__main__":
    main()

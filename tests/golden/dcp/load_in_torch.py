"""Load crate-written DCP directories into PyTorch FSDP models, for `tests/it/dcp_live.rs`.

    load_in_torch.py DCP_DIR EXPECTED.pt WS WRAPPER [DCP_DIR2 EXPECTED2.pt WS2 WRAPPER2 ...]

WRAPPER is `fsdp2` (`fully_shard`), `fsdp1_flat` or `fsdp1_orig` (FSDP1 with
`use_orig_params` False or True), wrapping `gen.py`'s `Net` (untied, nothing frozen) as
`gen.py` does; a `+tied` suffix (e.g. `fsdp2+tied`) takes the `Net` whose `out.weight` is
`embed.weight`. For each case, WS gloo ranks on CPU each build the model and an Adam
optimizer, take `get_optimizer_state_dict` (sharded), `dcp.load` the directory into it and
`set_optimizer_state_dict` it. EXPECTED.pt holds `{"optim": the full optimizer dict (keyed by
names) the crate saved}` and, when the directory holds the model too, `"model": {fqn:
tensor}`, which is then loaded as well (`set_model_state_dict`). Rank 0 compares
`get_optimizer_state_dict(full_state_dict=True)` with it: the same parameters with the same
state names, every tensor of the same dtype, shape and bytes, every option the crate saved
equal, each group's `params` equal as a set (after `set_state_dict` they follow the loading
optimizer's order); and `get_model_state_dict(full_state_dict=True)` tensor by tensor. Prints `CASE: ok` per case;
exits non-zero with the first difference. A spawn whose rank 0 wrote its result counts even
if its exit was bad (gloo sometimes aborts a process at exit); one without a result is retried.
"""

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_equal import same  # noqa: E402
from gen import Net, wrap  # noqa: E402


def compare(got, want):
    """The first difference between the loaded full dict and the crate's, or None."""
    if set(got["state"]) != set(want["state"]):
        return f"state keys {sorted(got['state'])} vs {sorted(want['state'])}"
    for fqn, st in want["state"].items():
        if set(got["state"][fqn]) != set(st):
            return f"state names of {fqn}: {sorted(got['state'][fqn])} vs {sorted(st)}"
        for name, v in st.items():
            try:
                same(v, got["state"][fqn][name], f"state[{fqn!r}][{name!r}]")
            except SystemExit as e:
                return str(e)
    if len(got["param_groups"]) != len(want["param_groups"]):
        return "number of param groups"
    for i, (g, w) in enumerate(zip(got["param_groups"], want["param_groups"])):
        for k, v in w.items():
            if k == "params":
                if set(g[k]) != set(v):
                    return f"param_groups[{i}]['params']: {g[k]} vs {v}"
            elif g.get(k) != v:
                return f"param_groups[{i}][{k!r}]: {g.get(k)!r} vs {v!r}"
    return None


def compare_model(got, want):
    """The first difference between the loaded full model state dict and the crate's."""
    if set(got) != set(want):
        return f"model keys {sorted(got)} vs {sorted(want)}"
    for k, v in want.items():
        try:
            same(v, got[k], f"model[{k!r}]")
        except SystemExit as e:
            return str(e)
    return None


def worker(rank, ws, port, ckpt, expected, wrapper, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    torch.manual_seed(1)
    try:
        want = torch.load(expected, weights_only=True)
        kind, _, tied = wrapper.partition("+")
        model = wrap(kind, Net(tied == "tied", False), ws)
        optim = torch.optim.Adam(model.parameters(), lr=0.5)
        state = {"optim": get_optimizer_state_dict(model, optim)}
        if "model" in want:
            state["model"] = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=ckpt)
        if "model" in want:
            set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        full_options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        full = get_optimizer_state_dict(model, optim, options=full_options)
        full_model = get_model_state_dict(model, options=full_options)
    except Exception as e:
        # A failure is a result too (the spawn then stops the other ranks).
        if rank == 0:
            (Path(out) / "result").write_text(f"rank 0 raised {e!r}")
        raise
    if rank == 0:
        problem = compare(full, want["optim"])
        if problem is None and "model" in want:
            problem = compare_model(full_model, want["model"])
        (Path(out) / "result").write_text(problem or "ok")
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ckpt, expected, ws, wrapper):
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as out:
            try:
                mp.spawn(
                    worker,
                    args=(ws, free_port(), ckpt, expected, wrapper, out),
                    nprocs=ws,
                    join=True,
                )
            except Exception as e:  # gloo sometimes aborts a process at exit after the work
                print(f"attempt {attempt} raised {e!r}", file=sys.stderr)
            result = Path(out) / "result"
            if result.exists():
                return result.read_text()
    return "no result after 3 attempts"


def main():
    args = sys.argv[1:]
    if not args or len(args) % 4:
        raise SystemExit(__doc__)
    for i in range(0, len(args), 4):
        ckpt, expected, ws, wrapper = args[i : i + 4]
        case = f"{ckpt} -> {wrapper} ws {ws}"
        result = run(ckpt, expected, int(ws), wrapper)
        if result != "ok":
            raise SystemExit(f"{case}: {result}")
        print(f"{case}: ok", flush=True)


if __name__ == "__main__":
    main()

"""PyTorch side of `benches/state_dict.rs`: FSDP2 (`fully_shard`, PyTorch 2.13) on CPU with gloo.

    .venv/bin/python benches/state_dict_side_by_side.py --layers 16 --reps 5

World size 2, ranks spawned with `torch.multiprocessing` on 127.0.0.1, one intra-op thread
each. The model is `--layers` `nn.Linear(--inp, --out)` in an `nn.Sequential`; `fully_shard`
is applied to each linear, then to the root, on `init_device_mesh("cpu", (2,))`. The optimizer
is `torch.optim.Adam(model.parameters(), lr=1e-3)` after one step on deterministic gradients
(no forward or backward), so each parameter has `step`, `exp_avg` and `exp_avg_sq` (DTensors
sharded on dim 0, `step` a plain 0-dim tensor).

Timed, each `--reps` times, wall clock on rank 0 from a barrier before the call to a barrier
after it:

* `get_full`: `get_optimizer_state_dict(model, optim,
  options=StateDictOptions(full_state_dict=True, cpu_offload=True))` (rank 0 gets the dict);
* `set_broadcast`: `set_optimizer_state_dict(model, optim, full if rank == 0 else {},
  options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`, with `full`
  made once, untimed, by `get_full`.

Peak RSS: before each repetition, `gc.collect()`, "5" into `/proc/self/clear_refs` (resets
VmHWM), VmRSS read; after the call, VmHWM. Per op and rank the largest VmHWM (`peak_rss`)
and VmHWM - VmRSS before (`peak_delta`), in bytes. One JSON object on stdout.
"""

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD = 2


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(name, fn, reps, rank, record):
    times, peaks, deltas = [], [], []
    ok = True
    for _ in range(reps):
        gc.collect()
        ok = reset_hwm() and ok
        before = status("VmRSS:")
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        peak = status("VmHWM:")
        dist.barrier()
        times.append(time.perf_counter() - t)
        peaks.append(peak)
        deltas.append(peak - before)
        del out
    record[name] = {"times": times, "peak_rss": max(peaks), "peak_delta": max(deltas), "clear_refs_ok": ok}


def worker(rank, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.inp, args.out) for _ in range(args.layers)])
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 1e-3 * (i + 1))
    optim.step()
    record = {}
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    measure("get_full", lambda: get_optimizer_state_dict(model, optim, options=full_opts), args.reps, rank, record)
    full = get_optimizer_state_dict(model, optim, options=full_opts)
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    measure("set_broadcast", lambda: set_optimizer_state_dict(model, optim, full if rank == 0 else {}, options=bcast), args.reps, rank, record)
    if rank == 0:
        record["tensor_bytes"] = sum(
            v.numel() * v.element_size() for st in full["state"].values() for v in st.values() if torch.is_tensor(v)
        )
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--inp", type=int, default=1526)
    ap.add_argument("--out", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    out = os.path.join(tempfile.mkdtemp(), "result")
    for attempt in range(3):
        try:
            mp.spawn(worker, args=(free_port(), args, out), nprocs=WORLD, join=True)
        except Exception as e:  # gloo sometimes aborts a process at exit after the work
            print(f"attempt {attempt}: {e!r}", file=sys.stderr)
        if all(os.path.exists(f"{out}.{r}") for r in range(WORLD)):
            break
    ranks = [json.load(open(f"{out}.{r}")) for r in range(WORLD)]
    print(json.dumps({"torch": torch.__version__, "ranks": ranks}))


if __name__ == "__main__":
    main()

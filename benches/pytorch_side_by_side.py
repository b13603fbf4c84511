"""PyTorch side of `benches/side_by_side.rs`: real FSDP (PyTorch 2.13) on CPU with gloo.

    .venv/bin/python benches/pytorch_side_by_side.py --layers 64 --reps 5 --dir DIR

World size 2, ranks spawned with `torch.multiprocessing` on 127.0.0.1 (a free port), FSDP with
`device_id=torch.device("cpu")`, `use_orig_params=False`. The model is `layers` = a
`ModuleList` of `--layers` `nn.Linear(--inp, --out)` (weight [out, inp], bias [out]), each
`nn.Linear` its own FSDP unit (`ModuleWrapPolicy({nn.Linear})`; the root holds no parameter
of its own). The optimizer is `torch.optim.Adam(model.parameters(), lr=1e-3)` after one step:
the gradient of every flat parameter is set to a deterministic closed formula (no forward or
backward; no RNG) and `step()` runs once, so the state is `step` (0-dim f32), `exp_avg`,
`exp_avg_sq` (the flat shard's shape) per flat parameter.

Each process runs with `torch.set_num_threads(--threads)` (default 1: one core per rank on
the 2-core host, as the crate runs one thread per rank).

Timed operations (each `--reps` times, `save` `--save-reps` times: writes vary most; the JSON
holds every repetition in seconds):

* `consolidate`: `FSDP.full_optim_state_dict(model, optim, rank0_only=True)`
* `sharded_load`: `FSDP.optim_state_dict_to_load(model, optim, sharded)` under
  `SHARDED_STATE_DICT`, where `sharded` is this rank's `FSDP.optim_state_dict(model, optim)`
  under `SHARDED_STATE_DICT` (made once, untimed)
* `shard_full`: `FSDP.shard_full_optim_state_dict(full, model)`, every rank holding the full
  dict (made once, untimed, with `rank0_only=False`)
* `save`: on rank 0, `torch.save(full, path)` then `os.fsync` of the file (rank 1 waits);
  the file from the previous repetition is removed first, untimed
* `consolidate_save` (only when named in `--ops`; `cargo bench --bench scale` runs it alone):
  `consolidate`, then rank 0 saves and fsyncs the full dict as `save` does: a consolidated
  checkpoint file from the live sharded state

`--ops` (comma-separated, default the first four) picks the operations run, in the order above.

Each operation's input (the sharded dict, the full dict) exists only while that operation is
measured; otherwise each process holds its FSDP model (flat parameter shards) and optimizer.

Timing: wall clock (`time.perf_counter`) on rank 0 from a barrier before the call to a
barrier after it, so a repetition ends when both ranks are done.

Peak RSS: before every repetition each process runs `gc.collect()`, writes "5" to
`/proc/self/clear_refs` (Linux: resets the VmHWM high-water mark to the current RSS) and reads
VmRSS; after the call (before the closing barrier) it reads VmHWM. Per operation and rank the
JSON holds the largest VmHWM over the repetitions (`peak_rss`) and the largest VmHWM - VmRSS
before (`peak_delta`), in bytes. `clear_refs_ok` says whether the reset worked; without it
VmHWM is the process's lifetime high-water mark.

Output: one JSON object on stdout (nothing else is printed there).
"""

import argparse
import gc
import json
import os
import socket
import sys
import time


def rss_fields():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.strip().split()[0]) * 1024
    return out


def reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, out_path):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import (
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)

    t_setup = time.perf_counter()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                [nn.Linear(args.inp, args.out) for _ in range(args.layers)]
            )

    with torch.no_grad():
        net = Net()
        for k, p in enumerate(net.parameters()):
            p.fill_(0.01 * (k + 1))
    model = FSDP(
        net,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        device_id=torch.device("cpu"),
        use_orig_params=False,
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            n = p.numel()
            i = torch.arange(n, dtype=torch.float32)
            p.grad = torch.sin(0.37 * i + 0.11 * (k + rank * 1000)).reshape(p.shape)
    optim.step()
    optim.zero_grad(set_to_none=True)
    del i
    # Global parameter count (the flat shards hold world-size padding).
    numel = torch.tensor([sum(p.numel() for p in model.parameters())], dtype=torch.int64)
    dist.all_reduce(numel)

    setup_s = time.perf_counter() - t_setup
    path = os.path.join(args.dir, "pytorch_full_optim.pt")
    hwm_ok = True
    held = {}  # the current operation's input, made untimed before its repetitions

    def prep_sharded_load():
        FSDP.set_state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            ShardedOptimStateDictConfig(),
        )
        held["sharded"] = FSDP.optim_state_dict(model, optim)

    def prep_full():
        held["full"] = FSDP.full_optim_state_dict(model, optim, rank0_only=False)

    def op_consolidate():
        return FSDP.full_optim_state_dict(model, optim, rank0_only=True)

    def op_sharded_load():
        return FSDP.optim_state_dict_to_load(model, optim, held["sharded"])

    def op_shard_full():
        return FSDP.shard_full_optim_state_dict(held["full"], model)

    def op_save():
        if rank == 0:
            with open(path, "wb") as f:
                torch.save(held["full"], f)
                f.flush()
                os.fsync(f.fileno())
        return None

    def op_consolidate_save():
        full = FSDP.full_optim_state_dict(model, optim, rank0_only=True)
        if rank == 0:
            with open(path, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
        return None

    # (name, prepare, op, keep the input for the next op)
    ops = [
        ("consolidate", None, op_consolidate, False),
        ("sharded_load", prep_sharded_load, op_sharded_load, False),
        ("shard_full", prep_full, op_shard_full, True),
        ("save", None, op_save, False),
        ("consolidate_save", None, op_consolidate_save, False),
    ]
    ops = [op for op in ops if op[0] in args.ops.split(",")]
    results = {}
    tensor_bytes = 0
    for name, prep, fn, keep in ops:
        if prep is not None:
            prep()
        if name == "save" and rank != 0:
            held.clear()  # only rank 0 saves
        if "full" in held:
            tensor_bytes = sum(
                v.numel() * v.element_size()
                for st in held["full"]["state"].values()
                for v in st.values()
                if torch.is_tensor(v)
            )
        times, peaks, deltas = [], [], []
        for _ in range(args.save_reps if name == "save" else args.reps):
            if rank == 0 and os.path.exists(path):
                os.remove(path)  # every save makes a new file (untimed)
            gc.collect()
            hwm_ok = reset_hwm() and hwm_ok
            before = rss_fields()["VmRSS"]
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            after = rss_fields()["VmHWM"]
            dist.barrier()
            times.append(time.perf_counter() - t0)
            del out
            peaks.append(after)
            deltas.append(after - before)
        results[name] = {
            "times": times,
            "peak_rss": max(peaks),
            "peak_delta": max(deltas),
            "rss_before": before,
        }
        if not keep:
            held.clear()
        gc.collect()
    file_size = os.path.getsize(path) if rank == 0 and os.path.exists(path) else 0
    if rank == 0 and os.path.exists(path):
        os.remove(path)

    gathered = [None, None]
    dist.all_gather_object(gathered, {"rank": rank, "results": results, "hwm_ok": hwm_ok})
    if rank == 0:
        doc = {
            "torch": torch.__version__,
            "world_size": 2,
            "threads_per_rank": args.threads,
            "layers": args.layers,
            "shape": [args.out, args.inp],
            "params": int(numel.item()),
            "full_tensor_bytes": tensor_bytes,
            "save_file_bytes": file_size,
            "reps": args.reps,
            "save_reps": args.save_reps,
            "setup_seconds": setup_s,
            "clear_refs_ok": all(g["hwm_ok"] for g in gathered),
            "ops": {},
        }
        for name, *_ in ops:
            doc["ops"][name] = {
                "times": results[name]["times"],
                "peak_rss": [g["results"][name]["peak_rss"] for g in gathered],
                "peak_delta": [g["results"][name]["peak_delta"] for g in gathered],
                "rss_before": [g["results"][name]["rss_before"] for g in gathered],
            }
        with open(out_path, "w") as f:
            json.dump(doc, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--out", type=int, default=1024)
    ap.add_argument("--inp", type=int, default=1526)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--save-reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default=".")
    ap.add_argument("--ops", default="consolidate,sharded_load,shard_full,save")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)

    import torch.multiprocessing as mp

    out_path = os.path.join(args.dir, "pytorch_side_by_side.%d.json" % os.getpid())
    mp.spawn(worker, args=(args, free_port(), out_path), nprocs=2, join=True)
    with open(out_path) as f:
        doc = json.load(f)
    os.remove(out_path)
    sys.stdout.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()

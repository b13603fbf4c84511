"""PyTorch's side of `cargo bench --bench dcp` (benches/dcp.rs).

    python benches/dcp_side_by_side.py make OUT.pt --embed ROWS --layers N
    python benches/dcp_side_by_side.py make_shared OUT.pt --embed ROWS --layers N
    python benches/dcp_side_by_side.py to_dcp IN.pt OUT_DIR       # torch_save_to_dcp
    python benches/dcp_side_by_side.py to_torch DCP_DIR OUT.pt    # dcp_to_torch_save
    python benches/dcp_side_by_side.py to_torch_synced DCP_DIR OUT.pt  # ... then fsync OUT.pt
    python benches/dcp_side_by_side.py same A.pt B.pt             # equal structure and bits

`make` writes what `get_state_dict` + `torch.save` would hold for a model with Adam state
after one step: {"model": {fqn: weight}, "optim": {"state": {fqn: {step, exp_avg,
exp_avg_sq}}, "param_groups": [...]}}, with an embedding of ROWS x 1024 and N layers of
1024 x 4096 (f32). `make_shared` writes the same dict with every tensor a view into shared
storages, as `torch.save` of FSDP1 flat parameters' views keeps it: the weights are views of
one flat f32 storage, each `exp_avg` and each `exp_avg_sq` of one more (three storages of all
the parameters' elements), plus `head.weight`, the embedding saved again (tied). The timed modes print one JSON line: {"seconds": ..., "peak_rss": bytes},
the peak being this process's ru_maxrss (the interpreter and torch included).
"""
import json
import os
import resource
import sys
import time

import torch


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make(out, embed, layers):
    g = torch.Generator().manual_seed(0)
    shapes = [("embed.weight", (embed, 1024))]
    shapes += [(f"layers.{i}.weight", (1024, 4096)) for i in range(layers)]
    model, state = {}, {}
    for name, shape in shapes:
        model[name] = torch.randn(shape, generator=g)
        state[name] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(shape, generator=g),
            "exp_avg_sq": torch.rand(shape, generator=g),
        }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "params": [n for n, _ in shapes]}]
    torch.save({"model": model, "optim": {"state": state, "param_groups": groups}}, out)


def make_shared(out, embed, layers):
    g = torch.Generator().manual_seed(0)
    shapes = [("embed.weight", (embed, 1024))]
    shapes += [(f"layers.{i}.weight", (1024, 4096)) for i in range(layers)]
    numel = sum(r * c for _, (r, c) in shapes)
    flat = {
        "param": torch.randn(numel, generator=g),
        "exp_avg": torch.randn(numel, generator=g),
        "exp_avg_sq": torch.rand(numel, generator=g),
    }
    model, state, at = {}, {}, 0
    for name, (r, c) in shapes:
        view = lambda kind: flat[kind][at:at + r * c].view(r, c)  # noqa: E731
        model[name] = view("param")
        state[name] = {"step": torch.tensor(1.0), "exp_avg": view("exp_avg"),
                       "exp_avg_sq": view("exp_avg_sq")}
        at += r * c
    model["head.weight"] = model["embed.weight"]
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "params": [n for n, _ in shapes]}]
    torch.save({"model": model, "optim": {"state": state, "param_groups": groups}}, out)


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))


def same(a, b):
    x = torch.load(a, weights_only=True)
    y = torch.load(b, weights_only=True)

    def walk(u, v, path):
        assert type(u) is type(v), f"{path}: {type(u)} vs {type(v)}"
        if isinstance(u, dict):
            assert list(u.keys()) == list(v.keys()), f"{path}: key order differs"
            for k in u:
                walk(u[k], v[k], f"{path}.{k}")
        elif isinstance(u, (list, tuple)):
            assert len(u) == len(v), f"{path}: length differs"
            for i, (p, q) in enumerate(zip(u, v)):
                walk(p, q, f"{path}[{i}]")
        elif isinstance(u, torch.Tensor):
            assert u.dtype == v.dtype and u.shape == v.shape, f"{path}: dtype/shape differ"
            bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 (NaNs compare too)
            assert torch.equal(bits(u), bits(v)), f"{path}: bits differ"
        else:
            assert u == v, f"{path}: {u!r} vs {v!r}"

    walk(x, y, "")
    print("same")


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "make":
        embed = int(args[args.index("--embed") + 1])
        layers = int(args[args.index("--layers") + 1])
        make(args[0], embed, layers)
    elif mode == "make_shared":
        embed = int(args[args.index("--embed") + 1])
        layers = int(args[args.index("--layers") + 1])
        make_shared(args[0], embed, layers)
    elif mode == "to_dcp":
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
        timed(torch_save_to_dcp, args[0], args[1])
    elif mode == "to_torch":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        timed(dcp_to_torch_save, args[0], args[1])
    elif mode == "to_torch_synced":
        # The same, made durable as the crate's output is (it fsyncs before its rename).
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        def synced(src, dst):
            dcp_to_torch_save(src, dst)
            with open(dst, "rb") as f:
                os.fsync(f.fileno())

        timed(synced, args[0], args[1])
    elif mode == "same":
        same(args[0], args[1])
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()

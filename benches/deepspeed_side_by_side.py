"""DeepSpeed's side of `cargo bench --bench deepspeed` (benches/deepspeed.rs).

Run with the DeepSpeed venv's Python (`scripts/setup-deepspeed-venv.sh`: DeepSpeed 0.19.8 on
the project's torch 2.13), never `.venv`'s, which has no DeepSpeed:

    $DS_VENV/bin/python benches/deepspeed_side_by_side.py make CKPT_DIR MADE.json --hidden H --layers N
    $DS_VENV/bin/python benches/deepspeed_side_by_side.py zero_to_fp32 CKPT_DIR OUT_DIR
    $DS_VENV/bin/python benches/deepspeed_side_by_side.py baseline  # the interpreter and imports alone
    $DS_VENV/bin/python benches/deepspeed_side_by_side.py same OURS.safetensors THEIRS_DIR

`make` (untimed) trains a synthetic fp32 model, N blocks of `up` = nn.Linear(H, 4H) and
`down` = nn.Linear(4H, H) with a residual (the largest parameters: `layers.{i}.up.weight`
[4H, H] and `layers.{i}.down.weight` [H, 4H]; no buffers, no tied weights), for one step under ZeRO stage 3 at world size 2 (gloo on
CPU, `torch.distributed.run --nproc-per-node 2` of this file's `worker` mode), with a client
`torch.optim.Adam` (`zero_allow_untested_optimizer`), and saves it with
`engine.save_checkpoint(CKPT_DIR, tag="step1")`. Every file of the checkpoint is then fsynced
(so that the bench can evict it from the page cache) and MADE.json written: {"hidden",
"layers", "params", "total_bytes" (the fp32 weights' bytes), "largest" (the largest
parameter's bytes), "tensors"}. When MADE.json already exists with the same H and N, the
checkpoint is reused as it is (making one takes a minute or two); the last line printed is
MADE.json's content either way.

The timed modes print one JSON line {"seconds": ..., "peak_rss": bytes}, the peak being this
process's ru_maxrss (the interpreter, torch and DeepSpeed included; `baseline` reports it for
the imports alone). The modules are imported before the clock starts.
- `zero_to_fp32`: `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
  CKPT_DIR, OUT_DIR, safe_serialization=True)` (DeepSpeed's documented offline conversion,
  what the `zero_to_fp32.py` script saved beside the checkpoint runs with
  `--safe_serialization`): one `OUT_DIR/model.safetensors` below its default 5GB shard size,
  then every file and the directory fsynced (the crate's output is durable when it returns).

`same` (untimed) checks that OURS.safetensors and THEIRS_DIR's one `model.safetensors` hold
the same tensors: names, dtypes, shapes and bytes (read with `safetensors.safe_open`), and
prints what it compared and whether the files are byte-identical (they are not expected to
be: the crate's header records the dict's structure in `__metadata__`).
"""
import filecmp
import json
import os
import resource
import socket
import subprocess
import sys
import time

# DeepSpeed picks its accelerator on import; this machine has no GPU (and the bench wants CPU).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

WORLD_SIZE = 2
TAG = "step1"
SETUP_HINT = ("run scripts/setup-deepspeed-venv.sh (after scripts/setup-venv.sh) and run this "
              "with its Python ($DS_VENV/bin/python, default /work/ds-venv)")


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))


def opt(args, name):
    return int(args[args.index(name) + 1])


def import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:
        sys.exit(f"no DeepSpeed in {sys.executable} ({e}): {SETUP_HINT}")
    return deepspeed


class Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, hidden, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def ds_config():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        # Smaller buckets than the defaults (5e8 elements) keep each rank's memory modest.
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000,
                              "stage3_prefetch_bucket_size": 50_000_000},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


# ----------------------------------------------------------------------------------------------
# `make`: one rank of the torchrun job (`worker`), and the driver.


def worker(ckpt_dir, hidden, layers):
    import torch.distributed as dist

    deepspeed = import_deepspeed()
    # Skip the ~70 s g++ JIT build of the shared-memory comm op: gloo does the collectives.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model(hidden, layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config())
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(2, hidden, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(ckpt_dir, tag=TAG)
    # ZeRO-3 processes sometimes abort at exit after the checkpoint is written.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsync_tree(d):
    for root, _, files in os.walk(d):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make(ckpt_dir, made_path, hidden, layers):
    if os.path.exists(made_path):
        with open(made_path) as f:
            made = json.load(f)
        if (made.get("hidden"), made.get("layers")) == (hidden, layers) and os.path.isdir(ckpt_dir):
            print(f"reusing the checkpoint {ckpt_dir} ({made_path})", file=sys.stderr)
            print(json.dumps(made))
            return
        os.remove(made_path)
    import_deepspeed()  # fail here, with the hint, rather than in two torchrun workers
    import shutil
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD_SIZE), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port",
        str(free_port()),
        os.path.abspath(__file__), "worker", ckpt_dir, "--hidden", str(hidden), "--layers", str(layers)
    ]
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
    fsync_tree(ckpt_dir)
    print(f"made {ckpt_dir} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    with torch.device("meta"):  # the shapes only, nothing allocated
        sizes = [p.numel() * p.element_size() for p in Model(hidden, layers).parameters()]
    made = {"hidden": hidden, "layers": layers, "params": sum(sizes) // 4, "total_bytes": sum(sizes),
            "largest": max(sizes), "tensors": len(sizes)}
    with open(made_path, "w") as f:
        json.dump(made, f)
    print(json.dumps(made))


# ----------------------------------------------------------------------------------------------
# The timed modes.


def fsync_dir(d):
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def zero_to_fp32(ckpt_dir, out_dir):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(ckpt_dir, out_dir, safe_serialization=True)
    fsync_dir(out_dir)


def preload():
    """The modules the timed mode uses, imported before the clock starts."""
    import_deepspeed()
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401
    import deepspeed.utils.zero_to_fp32  # noqa: F401


# ----------------------------------------------------------------------------------------------
# `same`.


def same(ours, theirs_dir):
    from safetensors import safe_open

    files = sorted(os.listdir(theirs_dir))
    assert files == ["model.safetensors"], f"zero_to_fp32 wrote {files}, not one model.safetensors"
    theirs = os.path.join(theirs_dir, "model.safetensors")
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 (NaNs compare too)
    with safe_open(ours, framework="pt") as a, safe_open(theirs, framework="pt") as b:
        ka, kb = sorted(a.keys()), sorted(b.keys())
        assert ka == kb, f"tensor names differ: {ka} vs {kb}"
        nbytes = 0
        for k in ka:
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype, f"{k}: dtype {x.dtype} vs {y.dtype}"
            assert x.shape == y.shape, f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
            assert torch.equal(bits(x), bits(y)), f"{k}: bytes differ"
            nbytes += x.numel() * x.element_size()
        meta_b = b.metadata()
    identical = filecmp.cmp(ours, theirs, shallow=False)
    print(f"outputs equal: {len(ka)} tensors, {nbytes} tensor bytes, same names, dtypes, shapes and "
          f"bytes; files {'byte-identical' if identical else 'not byte-identical'} "
          f"(zero_to_fp32's header metadata {meta_b})")


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode in ("zero_to_fp32", "baseline"):
        preload()
    if mode == "make":
        make(args[0], args[1], opt(args, "--hidden"), opt(args, "--layers"))
    elif mode == "worker":
        worker(args[0], opt(args, "--hidden"), opt(args, "--layers"))
    elif mode == "zero_to_fp32":
        timed(zero_to_fp32, args[0], args[1])
    elif mode == "baseline":
        timed(lambda: None)
    elif mode == "same":
        same(args[0], args[1])
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()

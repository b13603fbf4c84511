"""PyTorch continues the Rust example's FSDP2 run from its DCP checkpoint.

    .venv/bin/python examples/train_resume_torch.py CKPT_DIR CURVE.json [--world-size 2]

`examples/train_resume.rs --phase train --fsdp 2` trains a small transformer LM on per-parameter
shards (the crate's FSDP2 all-gather and reduce-scatter, the crate's Adam), saves a DCP
checkpoint (model and optimizer) after step K into CKPT_DIR and writes CURVE.json: its losses,
K (`save_at`), the model's sizes, the learning rate, the modules to apply `fully_shard` to, and
the global token batch of every step after K.

This script builds the same model in PyTorch (the same FQNs as the tch `VarStore` paths, the
forward written op for op as the tch forward), applies `fully_shard` to those modules in that
order on `init_device_mesh("cpu", (ws,))` (gloo, one spawned process per rank), loads the
Rust-written directory with `dcp.load` + `set_state_dict` (model and `torch.optim.Adam`), checks
that Adam's `step` is K, and trains the steps after K on the same batches (rank r of ws takes
sequences r * B / ws .. (r + 1) * B / ws of each global batch of B, as the Rust example does).
It prints both curves and exits non-zero unless every loss equals the Rust run's within a
relative tolerance of 1e-4 (the reasoning is at `REL_TOL` in the Rust example: the runs differ
only in how float sums are associated).
"""

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

REL_TOL = 1e-4


# ---------------------------------------------------------------------------------------------
# The model: the Rust example's `Gpt`, parameter for parameter and op for op. Every module that
# `fully_shard` may be applied to is called as a module, so FSDP2's hooks unshard it.


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        n, t, d = x.shape
        hd = d // self.heads

        def split_heads(y):
            return y.view(n, t, self.heads, hd).transpose(1, 2)

        qkv = F.linear(x, self.qkv.weight, self.qkv.bias).split(d, -1)
        q, k, v = split_heads(qkv[0]), split_heads(qkv[1]), split_heads(qkv[2])
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = (
            (q.matmul(k.transpose(-2, -1)) / math.sqrt(hd))
            .masked_fill(causal, float("-inf"))
            .softmax(-1, dtype=torch.float32)
        )
        y = att.matmul(v).transpose(1, 2).contiguous().view(n, t, d)
        return F.linear(y, self.proj.weight, self.proj.bias)


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        m = F.gelu(F.linear(x, self.fc.weight, self.fc.bias), approximate="none")
        return F.linear(m, self.proj.weight, self.proj.bias)


def layer_norm(ln, x):
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, h):
        h = h + self.attn(layer_norm(self.ln1, h))
        return h + self.mlp(layer_norm(self.ln2, h))


class Gpt(nn.Module):
    def __init__(self, vocab, d_model, heads, context, layers):
        super().__init__()
        self.vocab, self.context = vocab, context
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, dtype=torch.int64)
        h = F.embedding(idx, self.tok_emb.weight) + F.embedding(pos, self.pos_emb.weight)
        for b in self.blocks:
            h = b(h)
        return F.linear(layer_norm(self.ln_f, h), self.head.weight)

    def loss(self, tokens):
        """Mean next-token cross-entropy over `tokens` (`[batch, context + 1]`)."""
        inp = tokens.narrow(1, 0, self.context)
        target = tokens.narrow(1, 1, self.context)
        logits = self(inp).view(-1, self.vocab)
        return F.nll_loss(logits.log_softmax(-1, dtype=torch.float32), target.reshape(-1))


# ---------------------------------------------------------------------------------------------
# One rank


def local_batch(sequences, rank, ws):
    per_rank = len(sequences) // ws
    return torch.tensor(sequences[rank * per_rank : (rank + 1) * per_rank], dtype=torch.int64)


def continue_training(rank, ws, ckpt, run):
    """Loads the checkpoint into a fresh FSDP2 model and Adam, trains the steps after it and
    returns `[[step, global mean loss], ...]`."""
    torch.manual_seed(0)  # initial values are overwritten by the checkpoint
    model = Gpt(**run["model"])
    mesh = init_device_mesh("cpu", (ws,))
    for unit in run["fully_shard"]:
        fully_shard(model.get_submodule(unit), mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=run["lr"])

    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps = {float(st["step"]) for st in optim.state.values()}
    if steps != {float(run["save_at"])} or len(optim.state) != len(list(model.parameters())):
        raise RuntimeError(
            f"loaded Adam state for {len(optim.state)} parameters with steps {steps}; expected "
            f"every parameter at step {run['save_at']}"
        )

    curve = []
    for batch in run["batches"]:
        loss = model.loss(local_batch(batch["sequences"], rank, ws))
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        curve.append([batch["step"], total.item() / ws])
    return curve


def worker(rank, ws, port, ckpt, run, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # `Attention` and `Mlp` return `F.linear`'s output, a view; FSDP2 warns that an in-place op
    # on it would skip its pre-backward hook. `Block` adds them out of place (as the tch forward
    # does, op for op), so the warning does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        curve = continue_training(rank, ws, ckpt, run)
    except Exception as e:
        # A failure is a result too (the spawn then stops the other ranks).
        if rank == 0:
            (Path(out) / "result.json").write_text(json.dumps({"error": repr(e)}))
        raise
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps({"losses": curve}))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ckpt, run, ws):
    """Rank 0's result. A spawn whose rank 0 wrote its result counts even if its exit was bad
    (gloo sometimes aborts a process at exit); one without a result is retried."""
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as out:
            try:
                mp.spawn(worker, args=(ws, free_port(), ckpt, run, out), nprocs=ws, join=True)
            except Exception as e:
                print(f"attempt {attempt} raised {e!r}", file=sys.stderr)
            result = Path(out) / "result.json"
            if result.exists():
                return json.loads(result.read_text())
    return {"error": "no result after 3 attempts"}


# ---------------------------------------------------------------------------------------------
# Comparison


def compare(rust, torch_curve, ws_rust, ws_torch):
    """Prints both curves; the largest relative difference, or an error message."""
    want = {step: loss for step, loss in rust}
    print(f"{'step':>4}  {f'Rust (ws {ws_rust})':>22}  {f'PyTorch (ws {ws_torch})':>22}  rel diff")
    worst = 0.0
    for step, loss in torch_curve:
        if step not in want:
            return f"PyTorch trained step {step}, which the Rust run did not"
        rel = abs(loss - want[step]) / abs(want[step])
        worst = rel if math.isnan(rel) or rel > worst else worst
        print(f"{step:>4}  {want[step]:>22.9f}  {loss:>22.9f}  {rel:>8.2e}")
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="the DCP directory the Rust run saved")
    parser.add_argument("curve", help="the Rust training run's curve file (JSON)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    run = json.loads(Path(args.curve).read_text())
    if run.get("fsdp_version") != 2 or "batches" not in run:
        raise SystemExit(f"{args.curve} is not from a `--phase train --fsdp 2` run")
    if run["global_batch"] % args.world_size:
        raise SystemExit(f"the world size must divide the global batch of {run['global_batch']}")
    expected = [s for s, _ in run["losses"] if s > run["save_at"]]
    if [b["step"] for b in run["batches"]] != expected:
        raise SystemExit(f"{args.curve}: the batches do not cover steps {expected}")

    result = run_ranks(str(Path(args.ckpt).resolve()), run, args.world_size)
    if "error" in result:
        raise SystemExit(f"PyTorch FAILED to continue from {args.ckpt}: {result['error']}")
    got = result["losses"]
    worst = compare(run["losses"], got, run["world_size"], args.world_size)
    if isinstance(worst, str):
        raise SystemExit(worst)
    if [s for s, _ in got] != expected:
        raise SystemExit(f"PyTorch trained steps {[s for s, _ in got]}, expected {expected}")
    print(
        f"PyTorch FSDP2 continued from the Rust checkpoint after step {run['save_at']}: "
        f"{len(got)} steps compared, max relative difference {worst:.3e} (tolerance {REL_TOL:g})"
    )
    if math.isnan(worst) or worst > REL_TOL:
        raise SystemExit(
            f"PyTorch check FAILED: its losses differ from the Rust run's by up to {worst:.3e}"
        )
    print("PyTorch check passed")


if __name__ == "__main__":
    main()

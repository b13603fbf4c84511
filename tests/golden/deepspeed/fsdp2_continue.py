"""Check that the DCP directory `fsdp-ckpt convert DS_DIR OUT --to dcp` wrote of a DeepSpeed
golden case loads into PyTorch FSDP2 with its Adam state, and that training continues from the
DeepSpeed run's state. Used live by the Rust tests (tests/it/deepspeed.rs); needs no DeepSpeed.

    .venv/bin/python tests/golden/deepspeed/fsdp2_continue.py WORLD_SIZE CASE_DIR DCP_DIR [CASE_DIR DCP_DIR ...]

* WORLD_SIZE — how many gloo ranks (127.0.0.1, a free port) to spawn with
  `torch.multiprocessing`; every case is checked by the same ranks, one after another.
* CASE_DIR — a case of `gen.py` (e.g. `tests/golden/deepspeed/zero2_fp32`): its `case.json`,
  `expected_fp32.safetensors` (DeepSpeed's `zero_to_fp32`), `ucp/` (DeepSpeed's
  `ds_to_universal`) and, for fp32 cases, `after_one_step.safetensors`.
* DCP_DIR — the DCP directory written of that case's checkpoint.

Every rank builds `tiny_model.build_model()` in float32 (its frozen variant for a case whose
`case.json` lists `frozen` parameters), wraps it with FSDP2 (`fully_shard` on `fc1`, then the
root; the tied `emb` / `head_lm` stay in the root's group) and builds `tiny_model.make_optimizer`
(two param groups of the trainable parameters, the case's `torch.optim.Adam` or `AdamW`). It then loads, as an FSDP2
user would: `msd, osd = get_state_dict(model, optim)`, `dcp.load({"model": msd, "optim": osd})`,
`set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)`.

Checked on rank 0 from `get_state_dict(..., full_state_dict=True)`, exactly (`torch.equal`):
* the model state equals `expected_fp32.safetensors` (weights, the buffer, the tied alias; a
  frozen weight, which that file holds in the model dtype, as float32);
* each trained parameter's `exp_avg` and `exp_avg_sq` equal the universal checkpoint's files,
  its `step` equals the run's step count, a frozen parameter has no optimizer state (what
  `get_state_dict` gives of an FSDP2 model with it frozen), and each param group's
  hyper-parameters and members equal `case.json`'s.

For fp32 cases the ranks then train one step on `tiny_model.continue_batch()` (the same batch
on every rank, so the data-parallel mean gradient is that batch's whatever the world size) and
the weights must match DeepSpeed's own continuation (`after_one_step.safetensors`) within
`CONTINUE_ATOL` (FSDP2's reduce-scatter averages over a different number of ranks than
DeepSpeed did, so the last bits may differ). As a check that the test can fail, rank 0 also
continues a plain model from the same weights with a fresh Adam state: it must be far off.

Prints a line per case and exits 0 if all pass, 1 if a value differs, 2 if a checkpoint could
not be loaded at all or the ranks failed.
"""

import json
import os
import socket
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_model  # noqa: E402

# How far FSDP2's continued weights may be from DeepSpeed's (float32 Adam, lr <= 1e-2).
CONTINUE_ATOL = 1e-6
# A fresh Adam state must put the continued weights at least this much further off.
CONTROL_FACTOR = 100.0


def wrap(model, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def ucp_state(case_dir, name, state, shape):
    """A parameter's state from DeepSpeed's universal checkpoint: `{'cat_dim', 'param'}` from
    stages 1 and 2, a bare flat tensor from stage 3."""
    tag = (case_dir / "ucp" / "latest_universal").read_text().strip()
    t = torch.load(case_dir / "ucp" / tag / "zero" / name / f"{state}.pt", weights_only=True)
    if isinstance(t, dict):
        t = t["param"]
    return t.reshape(shape)


def compare(case_dir, case, full_m, full_o):
    """The differences of the loaded full state from DeepSpeed's own outputs (empty if none)."""
    from safetensors.torch import load_file

    bad = []
    expected = load_file(case_dir / "expected_fp32.safetensors")
    frozen = set(case.get("frozen", {}))
    frozen |= {a for a, p in case["tied"].items() if p in frozen}
    for k, want in expected.items():
        got = full_m.get(k)
        if k in frozen:
            want = want.float()
        if got is None:
            bad.append(f"model key {k} missing")
        elif got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(f"model {k} differs from zero_to_fp32's")
    extra = sorted(set(full_m) - set(expected))
    if extra:
        bad.append(f"model keys zero_to_fp32 lacks: {extra}")
    shapes = case["param_shapes"]
    for name in case["param_names"]:
        st = full_o["state"].get(name)
        if name in frozen:
            if st is not None:
                bad.append(f"frozen {name} has optimizer state {sorted(st)}")
            continue
        if st is None:
            bad.append(f"optim state of {name} missing")
            continue
        for s in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(st[s], ucp_state(case_dir, name, s, shapes[name])):
                bad.append(f"{name}.{s} differs from the universal checkpoint's")
        if float(st["step"]) != float(case["steps"]):
            bad.append(f"{name}.step is {float(st['step'])}, the run took {case['steps']}")
    groups = full_o["param_groups"]
    if len(groups) != len(case["param_groups"]):
        bad.append(f"{len(groups)} param groups, the run had {len(case['param_groups'])}")
    for i, (got, want) in enumerate(zip(groups, case["param_groups"])):
        if list(got["params"]) != want["members"]:
            bad.append(f"param group {i} lists {got['params']}, the run {want['members']}")
        for k, v in want["hyperparameters"].items():
            g = got.get(k)
            if isinstance(g, tuple):
                g = list(g)
            if g != v:
                bad.append(f"param group {i} {k} = {g!r}, the run had {v!r}")
    return bad


def continue_one_step(model, optim):
    ids, targets = tiny_model.continue_batch()
    model.train()
    optim.zero_grad(set_to_none=True)
    tiny_model.loss_fn(model, ids, targets).backward()
    optim.step()


def control_diff(case_dir, after):
    """How far a plain model continued from the same weights with a fresh Adam state lands."""
    from safetensors.torch import load_file

    model, optim = build(json.loads((case_dir / "case.json").read_text()))
    model.load_state_dict(load_file(case_dir / "expected_fp32.safetensors"))
    continue_one_step(model, optim)
    sd = model.state_dict()
    return max((sd[k] - v).abs().max().item() for k, v in after.items())


def build(case, ws=None):
    """The case's model (frozen variant when it lists `frozen` parameters), FSDP2-wrapped at
    `ws` ranks unless `ws` is None, and its optimizer."""
    model = tiny_model.build_model(frozen=bool(case.get("frozen")))
    if ws is not None:
        model = wrap(model, ws)
    cls = getattr(torch.optim, case["optimizer"]["class"].rsplit(".", 1)[-1])
    return model, tiny_model.make_optimizer(model, cls)


def check_case(rank, ws, case_dir, dcp_dir):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    case = json.loads((case_dir / "case.json").read_text())
    model, optim = build(case, ws)
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(dcp_dir))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_m, full_o = get_state_dict(model, optim, options=full)
    out = {"case": case_dir.name, "ok": True, "msg": []}
    if rank == 0:
        bad = compare(case_dir, case, full_m, full_o)
        if bad:
            out["ok"] = False
            out["msg"].append("; ".join(bad[:6]))
        else:
            out["msg"].append(f"model and Adam state equal DeepSpeed's ({len(full_m)} keys)")
    after_file = case_dir / "after_one_step.safetensors"
    if after_file.exists():
        continue_one_step(model, optim)
        full_m, _ = get_state_dict(model, optim, options=full)
        if rank == 0:
            after = load_file(after_file)
            diff = max((full_m[k] - v).abs().max().item() for k, v in after.items())
            control = control_diff(case_dir, after)
            if diff > CONTINUE_ATOL:
                out["ok"] = False
                out["msg"].append(f"one step on: max |diff| {diff:.3g} from DeepSpeed's "
                                  f"continuation (> {CONTINUE_ATOL})")
            elif control < CONTROL_FACTOR * CONTINUE_ATOL:
                out["ok"] = False
                out["msg"].append(f"a fresh Adam state lands only {control:.3g} off: the "
                                  "continuation check cannot tell the state was loaded")
            else:
                out["msg"].append(f"one step on: max |diff| {diff:.3g} from DeepSpeed's "
                                  f"continuation (a fresh Adam state: {control:.3g})")
    return out


def worker(rank, ws, port, pairs, result):
    # fully_shard(fc1) warns that nn.Linear returns a view; the model does no in-place op on it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        outs = [check_case(rank, ws, Path(c), Path(d)) for c, d in pairs]
        if rank == 0:
            Path(result).write_text(json.dumps(outs))
        dist.barrier()
    except BaseException as e:  # dcp's CheckpointException derives from BaseException
        if rank == 0:
            msg = f"{type(e).__name__}: {e}"
            failures = getattr(e, "failures", None)  # CheckpointException: rank -> exception
            if failures:
                r, f = sorted(failures.items())[0]
                if isinstance(f, tuple):  # (exception, traceback frames)
                    f = f[0]
                msg = f"rank {r}: {type(f).__name__}: {f}"
            Path(result).write_text(json.dumps({"error": msg.replace("\n", " ")[:2000]}))
        traceback.print_exc()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = sys.argv[1:]
    if len(args) < 3 or len(args) % 2 != 1:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    ws = int(args[0])
    pairs = list(zip(args[1::2], args[2::2]))
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        try:
            mp.spawn(worker, args=(ws, free_port(), pairs, str(result)), nprocs=ws, join=True)
        except Exception as e:  # gloo sometimes aborts a process at exit after the work
            print(f"fsdp2_continue: spawn raised {type(e).__name__}", file=sys.stderr)
        if not result.exists():
            print(f"fsdp2_continue: ERROR ws={ws}: the ranks produced no result")
            sys.exit(2)
        outs = json.loads(result.read_text())
    if "error" in outs:
        print(f"fsdp2_continue: ERROR ws={ws}: {outs['error']}")
        sys.exit(2)
    for o in outs:
        print(f"fsdp2_continue: {'OK' if o['ok'] else 'MISMATCH'} ws={ws} {o['case']}: "
              + "; ".join(o["msg"]))
    sys.exit(0 if all(o["ok"] for o in outs) else 1)


if __name__ == "__main__":
    main()

"""Golden fixtures from REAL DeepSpeed 0.19.8 ZeRO checkpoints (issue 28: a Rust DeepSpeed reader).

Regenerate (from the crate root; DeepSpeed lives in its own venv, never in `.venv`):

    scripts/setup-venv.sh && scripts/setup-deepspeed-venv.sh          # once
    /work/ds-venv/bin/python tests/golden/deepspeed/gen.py              # every case
    /work/ds-venv/bin/python tests/golden/deepspeed/gen.py zero2_bf16   # only the named cases
    .venv/bin/python tests/golden/deepspeed/check_format.py             # then check them

The ZeRO-3 rank-1 optimizer files change on every run: their partition padding is uninitialised
memory (FORMAT.md section 5); everything else is reproduced byte for byte.

For each case it launches `python -m torch.distributed.run --nproc-per-node 2` (gloo, CPU,
DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1) running this file with `--worker`, then converts the
checkpoint with DeepSpeed's own tools in this (single) process, so the Rust tests need no
DeepSpeed. Everything is seeded (model, data); see tiny_model.py for the model, the two Adam
param groups, the batches and the loss. The Rust tests never run this script.

Files (tests/golden/deepspeed/):

* `tiny_model.py` — the model (plain torch.nn), its param groups, data and loss; importable
  without DeepSpeed.
* `initial.safetensors` — the model's initial fp32 `state_dict()` (tied `head_lm.weight` is a
  separate copy of `emb.weight`; the non-persistent buffer `scratch` is not in it).
* `continue_batch.safetensors` — `ids`, `targets` (int64, (4, 6)) of the continuation step.
* `train_batches.safetensors` — `s{step}_r{rank}_ids` / `_targets` of the 3 training steps.
* `FORMAT.md` — the checkpoint format, the spec for the Rust reader.
* `check_format.py` — checks FORMAT.md against these files WITHOUT DeepSpeed (run it with the
  project's `.venv` after regenerating): rebuilds every parameter and its Adam state from the
  raw files and compares with the outputs below, and replays the continuation step.
* `zero{1,2,3}_{fp32,bf16}/` — one case each: ZeRO stage, model dtype (`bf16.enabled`), world
  size 2, client `torch.optim.Adam` (betas (0.9, 0.95), eps 1e-6), two param groups (lr 1e-2 /
  wd 0.1 and lr 3e-3 / wd 0.0), no gradient clipping, 3 steps on rank-specific batches.
  `zero1_bf16_fp32acc/` is a seventh case: bf16 with `data_types.grad_accum_dtype = "fp32"`,
  for which DeepSpeed takes its BF16_Optimizer at stage 1 (the Megatron-DeepSpeed setup), whose
  optimizer files differ (FORMAT.md).
* `frozen_zero{1,2,3}_{fp32,bf16}_ws{2,3}/` (issue 40; FROZEN_CASES) — the frozen variant of the
  model (`tiny_model.build_model(frozen=True)`: `emb.weight`, and with it the tied
  `head_lm.weight`, requires_grad=False) with a client `torch.optim.AdamW` over the trainable
  parameters in the same two groups, at the world size the name says. Their
  `expected_fp32.safetensors` is zero_to_fp32's output checked by `with_frozen` (the frozen
  weight in the model dtype, equal to the initial one); at stage 1, where zero_to_fp32 leaves
  the frozen weights and their aliases out, with them put back from `module` (`case.json`
  `zero_to_fp32_leaves_out`).

  Each case folder holds:
  - `ckpt/` — `engine.save_checkpoint(ckpt, tag="step3")` as written: `latest` (holds
    `step3`) and `step3/*_model_states.pt`, `step3/*_optim_states.pt`. The recovery scripts
    DeepSpeed copies into the tag folder (`zero_to_fp32.py`, `zero_to_torch.py`) are deleted
    (60 KB of Python each case; listed in case.json `removed_files`).
  - `expected_fp32.safetensors` — `deepspeed.utils.zero_to_fp32.
    get_fp32_state_dict_from_zero_checkpoint("ckpt")`: every parameter and persistent buffer
    as fp32, tied `head_lm.weight` included (a copy: safetensors stores no shared tensors).
    For zero1_bf16_fp32acc, which zero_to_fp32 refuses, the same dict built from ucp/'s fp32.pt.
  - `ucp/` — `python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/step3
    --output_folder ucp/step3` (`--inject_missing_state` for stages 1 and 2). It writes
    `ucp/latest_universal` (holds `step3`) beside its output folder, `ucp/step3/zero/<param>/
    {fp32,exp_avg,exp_avg_sq[,step]}.pt`, `ucp/step3/zero/optimizer_state.pt` and copies of
    the model-states files.
  - fp32 cases only: `after_one_step.safetensors` — the fp32 weights (same names as
    expected_fp32) after ONE more engine step from the saved state on `continue_batch` (the
    same batch on both ranks, so the averaged gradient is the batch's own gradient), as
    zero_to_fp32 of a second checkpoint (tag `step4`, in a temporary folder, not kept).
  - `case.json` — stage, dtype, world size, tag, the DeepSpeed config, parameter names in
    `named_parameters()` order with shapes, param groups (hyperparameters and member names),
    steps, tied names, buffers, the loss, file list with sizes, and `pickle_globals`: the
    `module.name` pairs of every GLOBAL / STACK_GLOBAL opcode in each file's `data.pkl`.
"""
import argparse
import glob
import json
import os
import pickletools
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import tiny_model as tm  # noqa: E402

WORLD_SIZE = 2
STEPS = 3
TAG = "step3"
CONTINUE_TAG = "step4"
# zero{stage}_{dtype}, plus zero1_bf16_fp32acc: bf16 with fp32 gradient accumulation, which at
# stage 1 makes DeepSpeed use its BF16_Optimizer (the Megatron-DeepSpeed setup) instead of the
# ZeRO optimizer: another optimizer-file layout, which zero_to_fp32 refuses.
CASES = [f"zero{stage}_{dtype}" for stage in (1, 2, 3) for dtype in ("fp32", "bf16")] + ["zero1_bf16_fp32acc"]
# Issue 40: the frozen variant of the model (tiny_model.build_model(frozen=True): `emb.weight`
# and its tied `head_lm.weight` frozen, torch.optim.AdamW over the trainable parameters), every
# stage and dtype, each stage at world sizes 2 and 3.
FROZEN_CASES = [
    "frozen_zero1_fp32_ws2", "frozen_zero1_bf16_ws3", "frozen_zero2_fp32_ws3", "frozen_zero2_bf16_ws2",
    "frozen_zero3_fp32_ws2", "frozen_zero3_bf16_ws3"
]
CASES += FROZEN_CASES


def parse_case(case):
    """(stage, dtype, fp32 gradient accumulation)"""
    parts = case.removeprefix("frozen_").split("_")
    return int(parts[0][len("zero"):]), parts[1], parts[2:] == ["fp32acc"]


def is_frozen(case):
    return case.startswith("frozen_")


def world_size(case):
    """The case's data-parallel world size: its `_ws<n>` suffix, else WORLD_SIZE."""
    last = case.split("_")[-1]
    return int(last[2:]) if last.startswith("ws") else WORLD_SIZE


def optimizer_class(case):
    return torch.optim.AdamW if is_frozen(case) else torch.optim.Adam


def ds_config(stage, dtype, fp32acc=False):
    config = {
        "train_micro_batch_size_per_gpu": tm.BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if fp32acc:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


# ----------------------------------------------------------------------------------------------
# The worker: one rank of a torchrun job.


def worker(args):
    import torch.distributed as dist

    import deepspeed
    # Skip the ~70 s g++ JIT build of the shared-memory comm op: gloo does the collectives.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    stage, dtype, fp32acc = parse_case(args.case)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == world_size(args.case)

    model = tm.build_model(frozen=is_frozen(args.case))
    optimizer = tm.make_optimizer(model, optimizer_class(args.case))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, dtype, fp32acc))

    for step in range(STEPS):
        ids, targets = tm.train_batch(step, rank)
        loss = tm.loss_fn(engine, ids, targets)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"[{args.case}] step {step} loss {loss.item():.6f}", flush=True)
    engine.save_checkpoint(args.ckpt, tag=TAG)

    if args.continue_ckpt:
        ids, targets = tm.continue_batch()
        loss = tm.loss_fn(engine, ids, targets)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"[{args.case}] continuation loss {loss.item():.6f}", flush=True)
        engine.save_checkpoint(args.continue_ckpt, tag=CONTINUE_TAG)

    # ZeRO-3 processes sometimes abort at exit after the checkpoint is written.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------------
# The driver.


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env():
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    return env


def run_workers(case, ckpt, continue_ckpt):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size(case)), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port",
        str(free_port()),
        os.path.abspath(__file__), "--worker", "--case", case, "--ckpt", ckpt
    ]
    if continue_ckpt:
        cmd += ["--continue-ckpt", continue_ckpt]
    subprocess.run(cmd, env=child_env(), check=True)


def save_safetensors(state_dict, path):
    """Every tensor cloned and contiguous: safetensors refuses shared storage (tied weights)."""
    from safetensors.torch import save_file
    save_file({k: v.detach().clone().contiguous() for k, v in state_dict.items()}, path)


def shared_names(state_dict):
    """{name: first name} for entries that are the same tensor object as an earlier entry."""
    first, out = {}, {}
    for k, v in state_dict.items():
        if id(v) in first:
            out[k] = first[id(v)]
        else:
            first[id(v)] = k
    return out


def zero_to_fp32(ckpt_dir):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(ckpt_dir)


def with_frozen(case, ckpt, tag, sd):
    """zero_to_fp32's output `sd` of a frozen case, checked, with what it leaves out put back.

    zero_to_fp32 takes frozen parameters from the model states' `frozen_param_fragments`, in
    the model dtype, after the buffers and before the trained parameters (then a tied alias of
    one shares its tensor). DeepSpeed saves those only from stage 2 on (`frozen_param_shapes`
    is None at stage 1), so at stage 1 zero_to_fp32 silently leaves the frozen parameters and
    their aliases out (asserted here): they are put back from `module` (the model-dtype weights
    stage 1 saves whole), where stage 2 would have them. Every frozen weight must still be the
    initial one (in the model dtype)."""
    if not is_frozen(case):
        return sd
    stage, dtype, _ = parse_case(case)
    frozen = tm.FROZEN_NAMES
    aliases = ["head_lm.weight"]
    files = sorted(glob.glob(os.path.join(ckpt, tag, "*model_states.pt")))
    model = torch.load(files[0], map_location="cpu", weights_only=False)
    initial = tm.build_model().state_dict()
    want_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if stage == 1:
        assert model["frozen_param_shapes"] is None and model["frozen_param_fragments"] is None
        assert not set(frozen + aliases) & set(sd), list(sd)
        buffers = [k for k in sd if k in model["buffer_names"]]
        out = {k: sd[k] for k in buffers}
        out.update({n: model["module"][n] for n in frozen})
        out.update({k: v for k, v in sd.items() if k not in buffers})
        for a in aliases:
            out[a] = out[model["shared_params"][a]]
        sd = out
    else:
        assert list(model["frozen_param_shapes"]) == frozen, model["frozen_param_shapes"]
        keys = list(sd)
        assert keys[len(model["buffer_names"]):][:len(frozen)] == frozen, keys
    for n in frozen:
        assert sd[n].dtype == want_dtype, (n, sd[n].dtype)
        assert torch.equal(sd[n], initial[n].to(want_dtype)), f"{case}: frozen {n} changed"
    return sd


def expected_from_ucp(ckpt, ucp_tag_dir):
    """zero_to_fp32's output, rebuilt from a universal checkpoint: parameters (param_shapes
    order), then buffers (as fp32), then shared names; ordered like zero_to_fp32's (buffers first)."""
    model = torch.load(os.path.join(ckpt, TAG, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
    sd = {b: model["module"][b].float() for b in model["buffer_names"]}
    for shapes in model["param_shapes"]:
        for name, shape in shapes.items():
            t = torch.load(os.path.join(ucp_tag_dir, "zero", name, "fp32.pt"), weights_only=False)["param"]
            assert t.shape == shape, (name, t.shape, shape)
            sd[name] = t
    for alias, primary in model["shared_params"].items():
        sd[alias] = sd[primary]
    return sd


def run_ds_to_universal(stage, tag_dir, out_dir):
    cmd = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir, "--output_folder",
        out_dir, "--num_extract_workers", "1", "--num_merge_workers", "1"
    ]
    if stage <= 2:
        cmd.append("--inject_missing_state")
    subprocess.run(cmd, env=child_env(), check=True)


def pickle_globals(path):
    """The `module.name` pairs of every GLOBAL / STACK_GLOBAL opcode in a torch.save zip's data.pkl
    (STACK_GLOBAL's two operands tracked through the string pushes and the memo)."""
    with zipfile.ZipFile(path) as z:
        [pkl] = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data = z.read(pkl)
    found = []
    memo, strings = {}, []  # strings: the recent pushes (str or None for anything else)
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            module, attr = arg.split(" ", 1)
            found.append(f"{module}.{attr}")
            strings.append(None)
        elif name == "STACK_GLOBAL":
            module, attr = strings[-2], strings[-1]
            assert isinstance(module, str) and isinstance(attr, str), (path, strings[-2:])
            found.append(f"{module}.{attr}")
            strings[-2:] = [None]
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                      "STRING"):
            strings.append(arg)
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = strings[-1] if strings else None
        elif name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(arg))
        else:
            strings.append(None)
    return sorted(set(found))


def file_kind(rel):
    base = os.path.basename(rel)
    if not base.endswith(".pt"):
        return None
    if rel.startswith("ckpt/"):
        if base.endswith("_optim_states.pt"):
            return "ckpt optim_states"
        if base.endswith("_model_states.pt"):
            return "ckpt model_states"
    if rel.startswith("ucp/"):
        if base == "optimizer_state.pt":
            return "ucp zero/optimizer_state.pt"
        if base.endswith("_model_states.pt"):
            return "ucp model_states (copy)"
        if base == "step.pt":
            return "ucp zero/<param>/step.pt"
        return "ucp zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt"
    return None


def json_value(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    return v


def layout(stage, dtype, fp32acc, tag_dir, ws=WORLD_SIZE):
    """Where every parameter sits in the flat optimizer tensors (FORMAT.md), read off the files.
    Stages 1/2: `offset` in the group's flat buffer (all ranks' partitions back to back),
    `rank_slices_start_numel` {rank: [start in that rank's partition, numel]}. Stage 3: `offset`
    in every rank's flat group, each rank holding `partition_numel` elements of the parameter."""
    prefix = "bf16_" if dtype == "bf16" else ""
    optim = [
        torch.load(os.path.join(tag_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
                   map_location="cpu",
                   weights_only=False)["optimizer_state_dict"] for r in range(ws)
    ]
    model_file = "mp_rank_00_model_states.pt" if stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shapes = torch.load(os.path.join(tag_dir, model_file), map_location="cpu", weights_only=False)["param_shapes"]
    groups = []
    for g, group_shapes in enumerate(shapes):
        params, offset = [], 0
        if stage <= 2:
            pads = [0] * len(group_shapes) if fp32acc else optim[0]["param_alignment_paddings"][g]
            part = optim[0]["base_optimizer_state"]["state"][g]["exp_avg"].numel()
            for (name, shape), pad in zip(group_shapes.items(), pads):
                n = shape.numel()
                ranks = {
                    r: [max(offset, r * part) - r * part, min(offset + n, (r + 1) * part) - max(offset, r * part)]
                    for r in range(ws) if max(offset, r * part) < min(offset + n, (r + 1) * part)
                }
                params.append({"name": name, "numel": n, "offset": offset, "padding_after": pad,
                               "rank_slices_start_numel": ranks})
                offset += n + pad
            groups.append({
                "params": params,
                "padded_group_numel": offset,
                "aligned_numel": part * ws,  # a multiple of 2 * world size
                "partition_numel": part,
                "group_paddings_per_rank": [o["group_paddings"][g] for o in optim],
                "single_partition_of_fp32_groups_numel_per_rank":
                [o["single_partition_of_fp32_groups"][g].numel() for o in optim],
            })
        else:
            for name, shape in group_shapes.items():
                n = shape.numel()
                pn = -(-n // ws)
                params.append({"name": name, "numel": n, "offset": offset, "partition_numel": pn,
                               "padding_numel": pn * ws - n})
                offset += pn
            groups.append({
                "params": params,
                "fp32_flat_groups_numel_per_rank": [o["fp32_flat_groups"][g].numel() for o in optim],
            })
            assert all(x == offset for x in groups[-1]["fp32_flat_groups_numel_per_rank"])
    return groups


def case_json(case, case_dir, removed, expected_source):
    stage, dtype, fp32acc = parse_case(case)
    ws = world_size(case)
    model = tm.build_model(frozen=is_frozen(case))
    named = dict(model.named_parameters())
    tag_dir = os.path.join(case_dir, "ckpt", TAG)
    optim = torch.load(glob.glob(os.path.join(tag_dir, "*zero_pp_rank_0_mp_rank_00_optim_states.pt"))[0],
                       map_location="cpu",
                       weights_only=False)["optimizer_state_dict"]
    base = optim["optimizer_state_dict"] if stage == 3 else optim["base_optimizer_state"]
    groups = []
    for g, members in zip(base["param_groups"], tm.group_members(model)):
        hp = {k: json_value(v) for k, v in g.items() if k != "params"}
        groups.append({"hyperparameters": hp, "members": members})
    files, globals_by_kind = {}, {}
    for path in sorted(glob.glob(os.path.join(case_dir, "**", "*"), recursive=True)):
        if not os.path.isfile(path):
            continue
        rel = os.path.relpath(path, case_dir)
        if rel == "case.json":
            continue
        files[rel] = os.path.getsize(path)
        kind = file_kind(rel)
        if kind is not None:
            globals_by_kind.setdefault(kind, set()).update(pickle_globals(path))
    return {
        "case": case,
        "stage": stage,
        "dtype": dtype,
        "world_size": ws,
        "tag": TAG,
        "steps": STEPS,
        "deepspeed_version": __import__("deepspeed").__version__,
        "torch_version": torch.__version__,
        "ds_config": ds_config(stage, dtype, fp32acc),
        "optimizer_wrapper": "BF16_Optimizer" if fp32acc else
        ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"),
        "expected_fp32_source": expected_source,
        "optimizer": {
            "class": f"torch.optim.{optimizer_class(case).__name__}",
            **{k: json_value(v) for k, v in tm.ADAM_KWARGS.items()}
        },
        "gradient_clipping": "off (ds_config gradient_clipping 0.0)",
        "param_names": list(named),
        "param_shapes": {n: list(p.shape) for n, p in named.items()},
        "param_groups": groups,
        "frozen": {n: list(p.shape) for n, p in named.items() if not p.requires_grad},
        # What DeepSpeed's zero_to_fp32 leaves out of its output, and expected_fp32 holds.
        "zero_to_fp32_leaves_out": ["emb.weight", "head_lm.weight"] if is_frozen(case) and stage == 1 else [],
        "tied": {"head_lm.weight": "emb.weight"},
        "buffers": {"pos_scale": [tm.HIDDEN]},
        "non_persistent_buffers": ["scratch"],
        "loss": "tiny_model.loss_fn: CE(class logits, targets) + 0.5 * CE(tied LM logits[:, :-1], ids[:, 1:]), "
        f"mean over tokens, in fp32; DeepSpeed averages the gradients over the {ws} ranks",
        "train_batches": "tiny_model.train_batch(step, rank) for step 0..2 (train_batches.safetensors)",
        "continue_batch": "tiny_model.continue_batch() on every rank (continue_batch.safetensors)"
        if dtype == "fp32" else None,
        "layout": layout(stage, dtype, fp32acc, tag_dir, ws),
        "removed_files": removed,
        "files": files,
        "pickle_globals": {k: sorted(v) for k, v in sorted(globals_by_kind.items())},
    }


def gen_case(case):
    stage, dtype, fp32acc = parse_case(case)
    case_dir = os.path.join(HERE, case)
    shutil.rmtree(case_dir, ignore_errors=True)
    os.makedirs(case_dir)
    ckpt = os.path.join(case_dir, "ckpt")
    with tempfile.TemporaryDirectory(prefix=f"ds-{case}-") as tmp:
        continue_ckpt = os.path.join(tmp, "continue") if dtype == "fp32" else None
        run_workers(case, ckpt, continue_ckpt)
        with open(os.path.join(ckpt, "latest")) as f:
            assert f.read().strip() == TAG

        if not fp32acc:
            sd = with_frozen(case, ckpt, TAG, zero_to_fp32(ckpt))
            shared = shared_names(sd)
            assert shared == {"head_lm.weight": "emb.weight"}, shared
            save_safetensors(sd, os.path.join(case_dir, "expected_fp32.safetensors"))
        if continue_ckpt:
            after = with_frozen(case, continue_ckpt, CONTINUE_TAG, zero_to_fp32(continue_ckpt))
            save_safetensors(after, os.path.join(case_dir, "after_one_step.safetensors"))

    removed = []
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        path = os.path.join(ckpt, script)  # DeepSpeed copies them into the save dir, not the tag dir
        if os.path.exists(path):
            os.remove(path)
            removed.append(f"ckpt/{script}")

    ucp_root = os.path.join(case_dir, "ucp")
    os.makedirs(ucp_root)
    run_ds_to_universal(stage, os.path.join(ckpt, TAG), os.path.join(ucp_root, TAG))
    if fp32acc:
        # zero_to_fp32 refuses BF16_Optimizer files (no `zero_stage`): take the parameters from
        # ds_to_universal's fp32.pt files instead, and buffers and tied names as zero_to_fp32 does.
        save_safetensors(expected_from_ucp(ckpt, os.path.join(ucp_root, TAG)),
                         os.path.join(case_dir, "expected_fp32.safetensors"))
        expected_source = "ucp/step3/zero/<param>/fp32.pt (zero_to_fp32 refuses BF16_Optimizer checkpoints)"
    else:
        expected_source = "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint"

    with open(os.path.join(case_dir, "case.json"), "w") as f:
        json.dump(case_json(case, case_dir, removed, expected_source), f, indent=1)
        f.write("\n")


def gen_common():
    model = tm.build_model()
    save_safetensors(model.state_dict(), os.path.join(HERE, "initial.safetensors"))
    ids, targets = tm.continue_batch()
    save_safetensors({"ids": ids, "targets": targets}, os.path.join(HERE, "continue_batch.safetensors"))
    batches = {}
    for step in range(STEPS):
        for rank in range(WORLD_SIZE):
            ids, targets = tm.train_batch(step, rank)
            batches[f"s{step}_r{rank}_ids"] = ids
            batches[f"s{step}_r{rank}_targets"] = targets
    save_safetensors(batches, os.path.join(HERE, "train_batches.safetensors"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"cases to regenerate (default: all of {CASES})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--continue-ckpt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ["DS_ACCELERATOR"] = "cpu"
    cases = args.cases or CASES
    for case in cases:
        if case not in CASES:
            parser.error(f"unknown case {case!r}; cases: {CASES}")
    gen_common()
    for case in cases:
        gen_case(case)


if __name__ == "__main__":
    main()

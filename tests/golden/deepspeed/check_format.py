"""Checks FORMAT.md against the fixtures, WITHOUT DeepSpeed (the project's `.venv` is enough):

    .venv/bin/python tests/golden/deepspeed/check_format.py        # every case
    .venv/bin/python tests/golden/deepspeed/check_format.py zero3_fp32

For every case it
1. loads every `.pt` file with `torch.load(weights_only=True)`, allowing only torch's default
   globals plus stand-ins for the three DeepSpeed globals that FORMAT.md lists (so the list is
   complete: any other global fails the load);
2. rebuilds every parameter, its Adam `exp_avg` / `exp_avg_sq` and `step` from the raw
   `*_optim_states.pt` files exactly as FORMAT.md describes (offsets, alignment padding,
   per-rank partitions), cross-checks `param_slice_mappings` (stages 1 and 2), and compares
   bit for bit with `expected_fp32.safetensors` (DeepSpeed's zero_to_fp32) and the universal
   checkpoint (`ucp/`);
   (frozen parameters from the model-states files: FORMAT.md section 3);
3. for fp32 cases, loads that state into a plain `tiny_model.TinyModel` (its frozen variant
   where `case.json` lists `frozen` parameters) and the `torch.optim.Adam` / `AdamW` of
   `case.json`, takes one step on `continue_batch.safetensors` and compares with
   `after_one_step.safetensors`.
Prints `ok <case>` per case; exits non-zero on the first mismatch.
"""
import enum
import json
import math
import os
import sys

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tiny_model as tm  # noqa: E402


# Stand-ins for the only non-torch globals DeepSpeed pickles into these files.
class LossScaler:  # NEWOBJ with (), then BUILD with {'cur_scale': 1.0, 'dynamic': False}
    pass


class ZeroStageEnum(int, enum.Enum):  # REDUCE(ZeroStageEnum, (stage,))
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


class fragment_address:  # NEWOBJ with (), then BUILD with {'numel': n, 'start': s}
    pass


DS_GLOBALS = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (fragment_address, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load(path):
    with torch.serialization.safe_globals(DS_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


def same(a, b, what):
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}, max diff {diff}")


def rebuild_stage12(tag_dir, model, ws, prefix):
    """{name: (fp32, exp_avg, exp_avg_sq, step)} from the ZeRO-1/2 optimizer files."""
    optim = [load(os.path.join(tag_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
             for r in range(ws)]
    assert optim[0]["partition_count"] == [ws] * len(model["param_shapes"])
    bf16_optimizer = "zero_stage" not in optim[0]  # BF16_Optimizer: no zero_stage, no param paddings
    assert bf16_optimizer or optim[0]["zero_stage"] == (2 if model["ds_config"]["zero_optimization"]["stage"] == 2 else 1)
    out = {}
    for g, shapes in enumerate(model["param_shapes"]):
        # fp32: each rank's partition with the group's trailing alignment padding cut off, so the
        # concatenation is the group's flat buffer minus its tail padding.
        fp32 = torch.cat([o["single_partition_of_fp32_groups"][g] for o in optim])
        # Adam state: each rank's partition WITH padding (all ranks the same length P).
        states = [o["base_optimizer_state"]["state"][g] for o in optim]
        part = states[0]["exp_avg"].numel()
        assert all(s["exp_avg"].numel() == part for s in states)
        exp_avg = torch.cat([s["exp_avg"] for s in states])
        exp_avg_sq = torch.cat([s["exp_avg_sq"] for s in states])
        step = states[0]["step"]
        assert all(torch.equal(s["step"], step) for s in states)
        numel_total = sum(math.prod(s) for s in shapes.values())
        pads = [0] * len(shapes) if bf16_optimizer else optim[0]["param_alignment_paddings"][g]
        aligned = 2 * ws * math.ceil((numel_total + sum(pads)) / (2 * ws))
        assert part * ws == aligned, (part, ws, aligned)
        for r, o in enumerate(optim):
            assert o["group_paddings"][g] == max(0, min(part, (r + 1) * part - (numel_total + sum(pads))))
            # the ZeRO optimizer cuts the padding off; BF16_Optimizer (no `zero_stage`) keeps it
            kept = part - o["group_paddings"][g] if "zero_stage" in o else part
            assert o["single_partition_of_fp32_groups"][g].numel() == kept
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            n = math.prod(shape)
            out[name] = tuple(t.narrow(0, offset, n).view(shape) for t in (fp32, exp_avg, exp_avg_sq)) + (step, )
            # param_slice_mappings: rank r holds [max(offset, r*P), min(offset+n, (r+1)*P)) of the
            # group at `start` = that minus r*P in its partition.
            for r, o in enumerate(optim):
                lo, hi = max(offset, r * part), min(offset + n, (r + 1) * part)
                m = o["param_slice_mappings"][g]
                if lo < hi:
                    assert (m[name].start, m[name].numel) == (lo - r * part, hi - lo), (name, r)
                else:
                    assert name not in m, (name, r)
            offset += n + pad
        assert offset <= fp32.numel()
    return out


def rebuild_stage3(tag_dir, model, ws, prefix):
    optim = [load(os.path.join(tag_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
             for r in range(ws)]
    assert optim[0]["partition_count"] == ws
    out = {}
    for g, shapes in enumerate(model["param_shapes"]):
        flats = [o["fp32_flat_groups"][g] for o in optim]
        states = [o["optimizer_state_dict"]["state"][g] for o in optim]
        step = states[0]["step"]
        sizes = {math.ceil(math.prod(s) / ws) for s in shapes.values()}
        assert all(f.numel() == sum(math.ceil(math.prod(s) / ws) for s in shapes.values()) for f in flats), sizes
        offset = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            pn = math.ceil(n / ws)  # every rank holds pn elements of every parameter

            def gather(per_rank):
                return torch.cat([t.narrow(0, offset, pn) for t in per_rank]).narrow(0, 0, n).view(shape)

            out[name] = (gather(flats), gather([s["exp_avg"] for s in states]),
                         gather([s["exp_avg_sq"] for s in states]), step)
            offset += pn
    return out


def rebuild_frozen(models, stage):
    """{name: weight} of the frozen parameters (FORMAT.md section 3), in the model dtype: at
    stage 1 the `module` entries that are no trained parameter, buffer or tied alias; at stage 2
    `frozen_param_fragments` (whole weights); at stage 3 every rank's `frozen_param_fragments`
    (partitions of ceil(numel / ws) elements) concatenated and cut to the shape."""
    model = models[0]
    if model.get("frozen_param_shapes") is None:
        assert stage == 1 and model.get("frozen_param_fragments") is None
        trained = {n for g in model["param_shapes"] for n in g}
        skip = trained | set(model["buffer_names"]) | set(model["shared_params"])
        return {n: t for n, t in model["module"].items() if n not in skip}
    out = {}
    for name, shape in model["frozen_param_shapes"].items():
        n, ws = math.prod(shape), len(models)
        parts = [m["frozen_param_fragments"][name] for m in models]
        assert all(p.numel() == math.ceil(n / ws) for p in parts), (name, [p.numel() for p in parts])
        out[name] = torch.cat(parts).narrow(0, 0, n).view(shape) if ws > 1 else parts[0]
        assert stage == 3 or ws == 1
    return out


def check_case(case):
    case_dir = os.path.join(HERE, case)
    info = json.load(open(os.path.join(case_dir, "case.json")))
    stage, ws = info["stage"], info["world_size"]
    root = os.path.join(case_dir, "ckpt")
    tag = open(os.path.join(root, "latest")).read().strip()
    assert tag == info["tag"]
    tag_dir = os.path.join(root, tag)
    prefix = "bf16_" if info["dtype"] == "bf16" else ""

    # 1. every .pt loads with the allow-list
    for dirpath, _, names in os.walk(case_dir):
        for n in names:
            if n.endswith(".pt"):
                load(os.path.join(dirpath, n))

    if stage <= 2:
        model = load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
        models = [model]
        params = rebuild_stage12(tag_dir, model, ws, prefix)
    else:
        models = [load(os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")) for r in range(ws)]
        model = models[0]
        for m in models[1:]:
            assert m["param_shapes"] == model["param_shapes"]
        params = rebuild_stage3(tag_dir, model, ws, prefix)
    assert list(params) == [n for g in info["param_groups"] for n in g["members"]]

    # 2. zero_to_fp32 = buffers (as fp32) + frozen parameters + parameters + shared names
    rebuilt = {}
    for b in model["buffer_names"]:
        rebuilt[b] = model["module"][b].float()
    frozen = rebuild_frozen(models, stage)
    assert list(frozen) == list(info.get("frozen", {})), list(frozen)
    rebuilt.update(frozen)
    rebuilt.update({n: p[0] for n, p in params.items()})
    for alias, primary in model["shared_params"].items():
        rebuilt[alias] = rebuilt[primary]
    expected = load_file(os.path.join(case_dir, "expected_fp32.safetensors"))
    assert sorted(expected) == sorted(rebuilt), (sorted(expected), sorted(rebuilt))
    for k in expected:
        same(rebuilt[k].contiguous(), expected[k], f"{case} zero_to_fp32 {k}")

    # UCP
    ucp = os.path.join(case_dir, "ucp")
    ucp_tag = open(os.path.join(ucp, "latest_universal")).read().strip()
    zero = os.path.join(ucp, ucp_tag, "zero")
    for name, (fp32, exp_avg, exp_avg_sq, step) in params.items():
        for key, t in (("fp32", fp32), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            got = load(os.path.join(zero, name, f"{key}.pt"))
            if stage <= 2:
                assert got["cat_dim"] == 0
                got = got["param"]
            else:
                t = t.reshape(-1)  # stage 3: a bare flat tensor
            same(got, t.contiguous(), f"{case} ucp {name}/{key}")
        if stage <= 2:
            same(load(os.path.join(zero, name, "step.pt")), step, f"{case} ucp {name}/step")
        else:
            assert not os.path.exists(os.path.join(zero, name, "step.pt"))
    extra = sorted(set(os.listdir(zero)) - set(params) - {"optimizer_state.pt"})
    if stage <= 2:
        # every module-state entry without optimizer state: buffers and the tied alias, from the
        # MODEL-DTYPE weights (bf16 for bf16 runs), as {'param': t.float()}
        assert extra == sorted(["pos_scale", "head_lm.weight", *frozen]), extra
        for n in extra:
            got = load(os.path.join(zero, n, "fp32.pt"))
            assert list(got) == ["param"], list(got)
            same(got["param"], model["module"][n].float(), f"{case} ucp {n}")
    else:
        assert extra == [], extra
    osd = load(os.path.join(zero, "optimizer_state.pt"))
    assert [{k: v for k, v in g.items()} for g in osd["param_groups"]] == \
        (load(os.path.join(tag_dir, f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
         ["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"]["param_groups"])

    # 3. continuation
    if info["dtype"] == "fp32":
        net = tm.build_model(frozen=bool(frozen))
        net.load_state_dict(expected)
        named = dict(net.named_parameters())
        groups = []
        for g in info["param_groups"]:
            hp = dict(g["hyperparameters"])
            hp["betas"] = tuple(hp["betas"])
            groups.append({"params": [named[n] for n in g["members"]], **hp})
        opt = getattr(torch.optim, info["optimizer"]["class"].rsplit(".", 1)[-1])(groups)
        for name, (_, exp_avg, exp_avg_sq, step) in params.items():
            opt.state[named[name]] = {
                "step": step.clone(),
                "exp_avg": exp_avg.clone().contiguous(),
                "exp_avg_sq": exp_avg_sq.clone().contiguous()
            }
        batch = load_file(os.path.join(HERE, "continue_batch.safetensors"))
        loss = tm.loss_fn(net, batch["ids"], batch["targets"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        after = load_file(os.path.join(case_dir, "after_one_step.safetensors"))
        sd = net.state_dict()
        worst = 0.0
        for k in after:
            torch.testing.assert_close(sd[k], after[k], rtol=1e-5, atol=1e-6, msg=f"{case} after_one_step {k}")
            worst = max(worst, (sd[k] - after[k]).abs().max().item())
        print(f"ok {case} (continuation max abs diff {worst:.3g})")
    else:
        print(f"ok {case}")


def main():
    cases = sys.argv[1:] or sorted(d for d in os.listdir(HERE) if d.startswith(("zero", "frozen_")))
    for case in cases:
        check_case(case)


if __name__ == "__main__":
    main()

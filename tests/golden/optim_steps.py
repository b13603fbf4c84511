"""Reference optimizer steps from real PyTorch for `tests/it/optim_parity.rs`.

Run manually (never from the tests) with the project's venv and commit the output beside it:

    /work/main/.venv/bin/python tests/golden/optim_steps.py

writes `tests/golden/optim_steps.json`. Deterministic: parameters and gradients come from
closed formulas (no RNG), so the Rust test can regenerate them and check them against the
stored bits:

    param k, element i (initial):  cos(0.23 * i + 0.5 * k) * (1 + 0.25 * k)
    grad of param k at step s:     sin(0.37 * i + 1.3 * s + 0.11 * k)

both computed in double precision and rounded to the parameter's dtype.

For every case and after every step the file records the parameters and `state_dict()` of the
real `torch.optim` optimizer (`torch`). For Adam/AdamW it also records `ieee_sqrt`: the same
`_single_tensor_adam` op sequence run with torch's own kernels, except that `Tensor.sqrt()` is
replaced by a correctly rounded square root. PyTorch's CPU `sqrt` calls MKL's `vsSqrt`/`vdSqrt`
in `VML_HA` mode, which is not correctly rounded (up to 1 ulp off for ~17% of f32 inputs and
~1.3% of f64 inputs, and CPU/MKL-version dependent), so that one op cannot be reproduced
portably. The replica is first checked to reproduce `torch.optim` bit for bit when it uses
torch's sqrt, so `ieee_sqrt` isolates exactly that difference.
"""

import json
import math
import os
import struct

import torch

STEPS = 3

BITS_FMT = {
    torch.float32: ("<f", "<I", 8),
    torch.float64: ("<d", "<Q", 16),
}
DTYPE_NAME = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
DTYPE_OF = {v: k for k, v in DTYPE_NAME.items()}


def tensor_bits(t):
    """Bit patterns of a tensor's elements as lowercase hex strings (row-major)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        ints = t.view(torch.int16).tolist()
        return ["%04x" % (v & 0xFFFF) for v in ints]
    ffmt, ifmt, width = BITS_FMT[t.dtype]
    return ["%0*x" % (width, struct.unpack(ifmt, struct.pack(ffmt, v))[0]) for v in t.tolist()]


def enc_tensor(t):
    return {
        "dtype": DTYPE_NAME[t.dtype],
        "shape": list(t.shape),
        "values": [float(v) for v in t.detach().reshape(-1).tolist()],
        "bits": tensor_bits(t),
    }


def enc_value(v):
    """Python value -> tagged JSON (bool before int: bool is an int in Python)."""
    if isinstance(v, bool):
        return {"bool": v}
    if isinstance(v, int):
        return {"int": v}
    if isinstance(v, float):
        return {"float": v, "bits": "%016x" % struct.unpack("<Q", struct.pack("<d", v))[0]}
    if v is None:
        return {"none": None}
    if isinstance(v, str):
        return {"str": v}
    if isinstance(v, tuple):
        return {"tuple": [enc_value(x) for x in v]}
    if isinstance(v, list):
        return {"list": [enc_value(x) for x in v]}
    if torch.is_tensor(v):
        return {"tensor": enc_tensor(v)}
    raise TypeError(f"cannot encode {type(v)}")


def enc_state_dict(sd):
    state = []
    for key, st in sd["state"].items():
        state.append({"key": key, "entries": [{"name": n, "value": enc_value(v)} for n, v in st.items()]})
    groups = []
    for g in sd["param_groups"]:
        groups.append(
            {
                "options": [{"key": k, "value": enc_value(v)} for k, v in g.items() if k != "params"],
                "params": g["params"],
            }
        )
    return {"state": state, "param_groups": groups}


def init_param(k, dtype, shape):
    n = math.prod(shape)
    vals = [math.cos(0.23 * i + 0.5 * k) * (1 + 0.25 * k) for i in range(n)]
    return torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(shape)


def make_grad(k, step, dtype, shape):
    n = math.prod(shape)
    vals = [math.sin(0.37 * i + 1.3 * step + 0.11 * k) for i in range(n)]
    return torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(shape)


def ieee_sqrt(t):
    """Correctly rounded elementwise sqrt (libm `sqrt` in double, then one rounding)."""
    flat = [math.sqrt(v) for v in t.double().reshape(-1).tolist()]
    return torch.tensor(flat, dtype=torch.float64).to(t.dtype).reshape(t.shape)


def replica_adam(params, grads, state, groups, sqrt_fn):
    """`torch.optim.Adam._single_tensor_adam` op for op, with a pluggable sqrt."""
    pid = 0
    with torch.no_grad():
        for group in groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            wd, amsgrad, maximize = group["weight_decay"], group["amsgrad"], group["maximize"]
            decoupled = group["decoupled_weight_decay"]
            for _ in group["params"]:
                i, pid = pid, pid + 1
                if grads[i] is None:
                    continue
                param = params[i]
                st = state.setdefault(i, {})
                if not st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(param)
                    st["exp_avg_sq"] = torch.zeros_like(param)
                    if amsgrad:
                        st["max_exp_avg_sq"] = torch.zeros_like(param)
                grad = grads[i] if not maximize else -grads[i]
                exp_avg, exp_avg_sq, step_t = st["exp_avg"], st["exp_avg_sq"], st["step"]
                step_t += 1
                if wd != 0:
                    if decoupled:
                        param.mul_(1 - lr * wd)
                    else:
                        grad = grad.add(param, alpha=wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                if amsgrad:
                    torch.maximum(st["max_exp_avg_sq"], exp_avg_sq, out=st["max_exp_avg_sq"])
                    denom = (sqrt_fn(st["max_exp_avg_sq"]) / bias_correction2_sqrt).add_(eps)
                else:
                    denom = (sqrt_fn(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)


def bits_equal(a, b):
    return tensor_bits(a) == tensor_bits(b) and list(a.shape) == list(b.shape)


F32_PARAMS = [("float32", [37]), ("float32", [3, 4]), ("float64", [5])]

# name, optimizer class, constructor kwargs, groups (list of (param indices, overrides as a list
# of pairs in dict order)), parameter specs, (step, param) pairs that get no gradient.
CASES = [
    ("adam_default", "Adam", {}, None, F32_PARAMS, [(0, 1)]),
    ("adam_weight_decay", "Adam", {"lr": 0.01, "weight_decay": 0.1}, None, F32_PARAMS, []),
    ("adam_amsgrad", "Adam", {"lr": 0.01, "betas": (0.8, 0.99), "amsgrad": True}, None, F32_PARAMS, []),
    ("adam_maximize_beta1_small", "Adam", {"lr": 0.02, "betas": (0.3, 0.9), "maximize": True}, None, F32_PARAMS, []),
    ("adamw_default", "AdamW", {"lr": 0.01}, None, F32_PARAMS, []),
    (
        "adamw_two_groups",
        "AdamW",
        {"lr": 0.01},
        [([0, 2], []), ([1], [("weight_decay", 0.5), ("lr", 0.02), ("amsgrad", True)])],
        F32_PARAMS,
        [(1, 2)],
    ),
    ("adam_bf16", "Adam", {"lr": 0.01, "weight_decay": 0.05}, None, [("bfloat16", [150]), ("float16", [9]), ("float16", [70])], []),
    ("sgd_plain", "SGD", {"lr": 0.1}, None, F32_PARAMS, []),
    ("sgd_momentum", "SGD", {"lr": 0.1, "momentum": 0.9}, None, F32_PARAMS, [(0, 2)]),
    ("sgd_nesterov_wd", "SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, None, F32_PARAMS, []),
    (
        "sgd_dampening_maximize",
        "SGD",
        {"lr": 0.05, "momentum": 0.5, "dampening": 0.3, "weight_decay": 0.2, "maximize": True},
        None,
        F32_PARAMS,
        [],
    ),
    (
        "sgd_two_groups",
        "SGD",
        {"lr": 0.1, "momentum": 0.9},
        [([2, 0], [("momentum", 0), ("lr", 0.3)]), ([1], [])],
        F32_PARAMS,
        [],
    ),
    ("sgd_bf16", "SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, None, [("bfloat16", [150]), ("float16", [9]), ("float16", [70])], []),
]


def run_case(name, opt_name, kwargs, groups_spec, param_specs, no_grad):
    params = [
        torch.nn.Parameter(init_param(k, DTYPE_OF[dt], shape)) for k, (dt, shape) in enumerate(param_specs)
    ]
    initial = [p.detach().clone() for p in params]
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}[opt_name]
    if groups_spec is None:
        groups_spec = [(list(range(len(params))), [])]
    groups = []
    for idx, overrides in groups_spec:
        g = {"params": [params[i] for i in idx]}
        g.update(dict(overrides))
        groups.append(g)
    opt = cls(groups, **kwargs)
    # Ids are positions in the concatenated groups.
    order = [i for idx, _ in groups_spec for i in idx]

    is_adam = opt_name in ("Adam", "AdamW")
    replicas = {}
    if is_adam:
        for label, fn in (("torch_sqrt", torch.sqrt), ("ieee_sqrt", ieee_sqrt)):
            replicas[label] = ([init_param(order[j], p.dtype, list(p.shape)) for j, p in enumerate(params_by(order, params))], {})

    steps = []
    grads_json = []
    for s in range(STEPS):
        grads = []
        for k, (dt, shape) in enumerate(param_specs):
            grads.append(None if (s, k) in no_grad else make_grad(k, s, DTYPE_OF[dt], shape))
        grads_json.append([None if g is None else tensor_bits(g) for g in grads])
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        record = {
            "params": [enc_tensor(p.detach()) for p in params],
            "state_dict": enc_state_dict(opt.state_dict()),
        }
        if is_adam:
            ordered_grads = [grads[i] for i in order]
            for label, fn in (("torch_sqrt", torch.sqrt), ("ieee_sqrt", ieee_sqrt)):
                rp, rs = replicas[label]
                replica_adam(rp, ordered_grads, rs, opt.param_groups, fn)
            # The replica with torch's sqrt must be torch.optim bit for bit.
            rp, rs = replicas["torch_sqrt"]
            for j, i in enumerate(order):
                assert bits_equal(rp[j], params[i].detach()), f"{name}: replica differs on param {i}"
                for n, v in rs.get(j, {}).items():
                    assert bits_equal(v, opt.state[params[i]][n]), f"{name}: replica state {n} differs"
            rp, rs = replicas["ieee_sqrt"]
            record["ieee_sqrt"] = {
                # Indexed like `params` (by parameter, not by optimizer id).
                "params": [enc_tensor(rp[order.index(k)]) for k in range(len(params))],
                "state": [
                    {"key": j, "entries": [{"name": n, "value": enc_value(v)} for n, v in st.items()]}
                    for j, st in rs.items()
                ],
            }
        steps.append(record)

    return {
        "name": name,
        "optimizer": opt_name,
        "kwargs": [{"key": k, "value": enc_value(v)} for k, v in kwargs.items()],
        "groups": [{"params": idx, "overrides": [{"key": k, "value": enc_value(v)} for k, v in ov]} for idx, ov in groups_spec],
        "param_specs": [{"dtype": dt, "shape": shape} for dt, shape in param_specs],
        "initial_params": [enc_tensor(t) for t in initial],
        "grads": grads_json,
        "steps": steps,
    }


def params_by(order, params):
    return [params[i] for i in order]


def main():
    out = {
        "torch_version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "grad_formula": "sin(0.37*i + 1.3*step + 0.11*k)",
        "param_formula": "cos(0.23*i + 0.5*k) * (1 + 0.25*k)",
        "cases": [run_case(*c) for c in CASES],
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_steps.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} ({len(out['cases'])} cases)")


if __name__ == "__main__":
    main()

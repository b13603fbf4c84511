"""Writes the torch.save fixtures of tests/it/torch_save.rs into tests/golden/torch_save/.

Run with PyTorch 2.13:  .venv/bin/python tests/golden/torch_save_fixtures.py
Each `<name>.pt` gets a `<name>.json` beside it describing its contents bit for bit (see
check_torch_load.py for the format). `legacy.pt` uses the pre-1.6 format and has no JSON: the
test reads it as `{"a": torch.ones(2)}` (tests/golden/torch_load/ covers the format further).
"""

import collections
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from check_torch_load import describe  # noqa: E402

OUT = Path(__file__).parent / "torch_save"


def save(name, obj, shared=()):
    torch.save(obj, OUT / f"{name}.pt")
    (OUT / f"{name}.json").write_text(
        json.dumps({"object": describe(obj), "shared": [list(g) for g in shared]}, separators=(",", ":"))
        + "\n"
    )


def adam_int_keys():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    opt = torch.optim.Adam(
        [
            {"params": params[:2], "lr": 1e-3},
            {"params": params[2:], "lr": 5e-4, "betas": (0.8, 0.99), "weight_decay": 0.01},
        ]
    )
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
    return opt.state_dict()


def named_state():
    torch.manual_seed(1)
    sd = {
        "state": {
            "layer.weight": {
                "step": torch.tensor(7.0),
                "exp_avg": torch.randn(2, 3),
                "exp_avg_sq": torch.rand(2, 3),
            },
            "layer.bias": {
                "step": torch.tensor(7.0),
                "exp_avg": torch.randn(2),
                "exp_avg_sq": torch.rand(2),
            },
            "user_state": {"note": "hello", "count": 3, "flag": True, "nothing": None},
        },
        "param_groups": [
            {
                "lr": 0.01,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "amsgrad": False,
                "foreach": None,
                "params": ["layer.bias", "layer.weight"],
            }
        ],
    }
    return sd


def model_state():
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1, bias=False)
    )
    model.train()
    model(torch.randn(6, 3))
    return model.state_dict()


def dtypes():
    return {
        "f32": torch.tensor([1.5, -0.0, math.inf, math.nan, 1e-45], dtype=torch.float32),
        "f64": torch.tensor([[1.0 / 3.0, -2.5], [1e300, -math.inf]], dtype=torch.float64),
        "f16": torch.tensor([0.1, 65504.0, -6e-8], dtype=torch.float16),
        "bf16": torch.tensor([[1.0, 3.14159], [-1e30, 0.5]], dtype=torch.bfloat16),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0], dtype=torch.int64),
        "i32": torch.tensor([-(2**31), 7], dtype=torch.int32),
        "u8": torch.tensor([0, 128, 255], dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True]]),
        "scalar_f32": torch.tensor(2.5),
        "scalar_f64": torch.tensor(-1.25, dtype=torch.float64),
        "scalar_f16": torch.tensor(3.0, dtype=torch.float16),
        "scalar_bf16": torch.tensor(-7.0, dtype=torch.bfloat16),
        "scalar_i64": torch.tensor(42),
        "scalar_i32": torch.tensor(-3, dtype=torch.int32),
        "scalar_u8": torch.tensor(9, dtype=torch.uint8),
        "scalar_bool": torch.tensor(True),
        "empty": torch.zeros(0),
        "empty_2d": torch.zeros(2, 0, dtype=torch.float64),
        "three_d": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4),
        "five_d": torch.arange(32, dtype=torch.float32).reshape(2, 2, 2, 2, 2),
    }


def more_dtypes():
    # What an 8-bit optimizer (bitsandbytes-style) keeps, and the other integer and float8
    # dtypes; uint16/32/64 and float8 are pickled as UntypedStorage + _rebuild_tensor_v3.
    q = torch.tensor([[-128, -1, 0], [1, 64, 127]], dtype=torch.int8)
    u16 = torch.arange(12, dtype=torch.int32).to(torch.uint16).reshape(3, 4) * 5000
    return {
        "state": {
            0: {
                "step": torch.tensor(3.0),
                "state1": q,
                "absmax1": torch.tensor([0.5, 2.0]),
                "state1_t": q.t(),
                "scalar_i8": torch.tensor(-5, dtype=torch.int8),
            },
        },
        "i16": torch.tensor([-(2**15), -1, 2**15 - 1], dtype=torch.int16),
        "u16": u16,
        "u16_col": u16[:, 1],
        "u32": torch.tensor([0, 2**32 - 1, 123456789], dtype=torch.uint32),
        "u64": torch.tensor([0, 2**63 + 5, 2**64 - 1], dtype=torch.uint64),
        "u64_tail": torch.tensor([1, 2, 3, 4], dtype=torch.uint64)[2:],
        "f8e4m3fn": torch.tensor([0.0, -1.5, 448.0, 0.001953125, math.nan], dtype=torch.float8_e4m3fn),
        "f8e5m2": torch.tensor([0.0, -1.5, 57344.0, math.inf, 1.52587890625e-05], dtype=torch.float8_e5m2),
        "scalar_u32": torch.tensor(7, dtype=torch.uint32),
    }


def views():
    base = torch.arange(12, dtype=torch.float32)
    m = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    obj = {
        "base": base,
        "head": base[:4],
        "tail": base[8:],
        "grid": base.view(3, 4),
        "transposed": m.t(),
        "offset_only": torch.arange(10, dtype=torch.int64)[3:7],
        "strided": torch.arange(10, dtype=torch.int32)[1::3],
        "expanded": torch.tensor([5.0, 6.0]).unsqueeze(1).expand(2, 3),
        "col_of_3d": torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)[:, 1:, 2],
    }
    shared = [[["base"], ["head"], ["tail"], ["grid"]]]
    return obj, shared


def misc():
    return {
        "ints": [0, 1, 255, 256, 65535, 65536, -1, -129, 2**31 - 1, -(2**31), 2**31, 2**63 - 1, -(2**63)],
        "big_ints": [2**64, -(2**70), 2**100 + 12345, -(2**63) - 1],
        "floats": (0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324),
        "none": None,
        "bools": [True, False],
        "strings": ["", "ascii", "ünïcödé ✓", "line\nbreak"],
        "bytes": b"\x00\x01\xff raw",
        "empty": {"tuple": (), "list": [], "dict": {}, "odict": collections.OrderedDict()},
        "nested": {"a": {"b": {"c": [1, (2, [3, {"d": None}])]}}, 7: "int key", (1, 2): "tuple key"},
        "long_list": list(range(1001)),
        "tuple4": (1, 2, 3, 4),
        "size": torch.Size([2, 3]),
        "odict": collections.OrderedDict([("z", 1), ("a", torch.tensor([1, 2], dtype=torch.int32))]),
    }


def main():
    OUT.mkdir(exist_ok=True)
    for old in OUT.glob("*"):
        old.unlink()
    save("adam_int_keys", adam_int_keys())
    save("named_state", named_state())
    save("model_state", model_state())
    save("dtypes", dtypes())
    obj, shared = views()
    save("views", obj, shared)
    save("misc", misc())
    save("more_dtypes", more_dtypes())
    torch.save({"a": torch.ones(2)}, OUT / "legacy.pt", _use_new_zipfile_serialization=False)
    print(f"wrote fixtures to {OUT}")


if __name__ == "__main__":
    main()

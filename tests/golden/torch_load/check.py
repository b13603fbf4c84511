"""PyTorch's side of tests/it/torch_load.rs, asked at test time.

    check.py verdicts FILE...   one JSON line per file: {"file", "reads": bool, "error",
                                "object": describe(obj)} from torch.load(weights_only=True)
    check.py same A B [A B]...  exits non-zero unless torch.load(A) equals torch.load(B) for
                                every pair: values bit for bit, dtype, shape, layout,
                                requires_grad, Parameter or not, attributes, sparse indices,
                                quantization parameters

`import torch.distributed.tensor` first: it registers DTensor's safe globals, as a user who
loads distributed checkpoints has.
"""

import collections
import json
import struct
import sys
import warnings

import torch
import torch.distributed.tensor  # noqa: F401  (DTensor's safe globals)

warnings.filterwarnings("ignore")

DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "bool",
    torch.int8: "i8", torch.int16: "i16", torch.uint16: "u16", torch.uint32: "u32",
    torch.uint64: "u64", torch.float8_e4m3fn: "f8e4m3fn", torch.float8_e5m2: "f8e5m2",
    torch.complex64: "c64", torch.complex128: "c128",
}


def bits(x):
    return str(struct.unpack("<Q", struct.pack("<d", x))[0])


def dense(t):
    c = t.detach().clone().contiguous().reshape(-1)
    return {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "hex": bytes(c.untyped_storage().tolist()).hex()}


def tensor_value(t):
    if t.is_nested:
        return {"nested": len(t.unbind())}
    if t.is_meta:
        return {"meta": {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "stride": list(t.stride())}}
    if t.is_quantized:
        q = t.qscheme()
        if q == torch.per_tensor_affine:
            scheme = {"per_tensor": [bits(t.q_scale()), t.q_zero_point()]}
        else:
            scheme = {
                "per_channel": {
                    "float_qparams": q == torch.per_channel_affine_float_qparams,
                    "scales": dense(t.q_per_channel_scales()),
                    "zero_points": dense(t.q_per_channel_zero_points()),
                    "axis": t.q_per_channel_axis(),
                }
            }
        return {"quantized": {"dtype": str(t.dtype), "int_repr": dense(t.int_repr()), "scheme": scheme}}
    if t.layout == torch.sparse_coo:
        return {
            "sparse_coo": {
                "indices": dense(t._indices()),
                "values": dense(t._values()),
                "size": list(t.shape),
                "coalesced": t.is_coalesced(),
            }
        }
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        c, p = t.crow_indices(), t.col_indices()
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        c, p = t.ccol_indices(), t.row_indices()
    else:
        return {"tensor": dense(t)}
    return {
        "sparse_compressed": {
            "layout": str(t.layout),
            "compressed": dense(c),
            "plain": dense(p),
            "values": dense(t.values()),
            "size": list(t.shape),
        }
    }


def describe(obj):
    """The JSON form tests/it/torch_load.rs compares with; floats as their IEEE-754 bits."""
    if obj is None:
        return {"none": None}
    if isinstance(obj, bool):
        return {"bool": obj}
    if isinstance(obj, int):
        return {"int": str(obj)}
    if isinstance(obj, float):
        return {"float": bits(obj)}
    if isinstance(obj, complex):
        return {"complex": [bits(obj.real), bits(obj.imag)]}
    if isinstance(obj, str):
        return {"str": obj}
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    if isinstance(obj, bytearray):
        return {"bytearray": bytes(obj).hex()}
    if isinstance(obj, (torch.dtype, torch.layout, torch.qscheme)):
        return {"torch": str(obj)}
    if isinstance(obj, torch.device):
        return {"device": [obj.type, obj.index]}
    if isinstance(obj, torch.Tensor):
        value = tensor_value(obj)
        extras = {k: v for k, v in vars(obj).items()}
        parameter = isinstance(obj, torch.nn.Parameter)
        if list(value) == ["tensor"] and not parameter and not obj.requires_grad and not extras:
            return value
        return {
            "rich": {
                "value": value,
                "requires_grad": obj.requires_grad,
                "parameter": parameter,
                "attrs": [[k, describe(v)] for k, v in extras.items()],
            }
        }
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    if isinstance(obj, tuple):
        return {"tuple": [describe(x) for x in obj]}
    if isinstance(obj, list):
        return {"list": [describe(x) for x in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"set": [describe(x) for x in obj]}
    if isinstance(obj, collections.Counter):
        return {"counter": [[describe(k), describe(v)] for k, v in obj.items()]}
    if isinstance(obj, collections.OrderedDict):
        attrs = [[k, describe(v)] for k, v in vars(obj).items()]
        return {"odict": [[describe(k), describe(v)] for k, v in obj.items()], "attrs": attrs}
    if isinstance(obj, dict):
        return {"dict": [[describe(k), describe(v)] for k, v in obj.items()]}
    raise TypeError(f"cannot describe {type(obj)}")


def verdicts(files):
    for f in files:
        try:
            obj = torch.load(f, weights_only=True)
        except Exception as e:  # noqa: BLE001  (any refusal is a verdict)
            print(json.dumps({"file": f, "reads": False, "error": str(e).splitlines()[0][:300]}))
            continue
        print(json.dumps({"file": f, "reads": True, "object": describe(obj)}))


def same(pairs):
    for a, b in pairs:
        da = describe(torch.load(a, weights_only=True))
        db = describe(torch.load(b, weights_only=True))
        if da != db:
            sys.exit(f"{b} loads differently from {a}:\n{json.dumps(db)[:1500]}\n{json.dumps(da)[:1500]}")
        print(f"same {a} {b}")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "verdicts":
        verdicts(args)
    elif cmd == "same":
        same(list(zip(args[::2], args[1::2])))
    else:
        sys.exit(f"unknown command {cmd}")

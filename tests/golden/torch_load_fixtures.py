"""Writes tests/golden/torch_load/: one small torch.save file per kind of value that
`torch.load(weights_only=True)` reads (and a few it refuses), for tests/it/torch_load.rs.

Run with PyTorch 2.13 from the crate root:  .venv/bin/python tests/golden/torch_load_fixtures.py

The files carry no expectations: tests/golden/torch_load/check.py asks the installed PyTorch
(after `import torch.distributed.tensor`, which registers DTensor's safe globals) at test time
whether it reads each file and what it reads, and the test compares the crate's answer with it.
`expected.json` lists the one deliberate difference, kinds the crate refuses by name although
weights_only reads them, with the reason.
"""

import collections
import copyreg
import json
import os
import pickle
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

warnings.filterwarnings("ignore")
OUT = Path(__file__).resolve().parent / "torch_load"


Opt = collections.namedtuple("Opt", "lr")


class NewObjParameter:
    """Pickles as `NEWOBJ(torch.nn.Parameter, (data,))`, the form weights_only also reads."""

    def __init__(self, data):
        self.data = data

    @property
    def __class__(self):  # what pickle's NEWOBJ check compares with `__newobj__`'s class
        return nn.Parameter

    def __reduce_ex__(self, protocol):
        return (copyreg.__newobj__, (nn.Parameter, self.data))


def save(name, obj, **kw):
    torch.save(obj, OUT / f"{name}.pt", **kw)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


def fsdp_full_state_dicts():
    """FSDP1 FULL_STATE_DICT and get_state_dict(full_state_dict=True) of one gloo rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = FSDP(Net(), device_id=torch.device("cpu"))
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                sd = model.state_dict()
            assert any(hasattr(t, "_has_been_cloned") for t in sd.values()), "no attributes"
            save("fsdp1_full_state_dict", sd)
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
            save("get_state_dict_full", {"model": msd, "optim": osd})
        finally:
            dist.destroy_process_group()


def main():
    OUT.mkdir(exist_ok=True)
    for f in OUT.glob("*.pt"):
        f.unlink()
    torch.manual_seed(1)
    fsdp_full_state_dicts()

    # Parameters and tensor flags.
    save("parameter", {"w": nn.Parameter(torch.randn(2, 3))})
    save("parameter_frozen", {"w": nn.Parameter(torch.randn(3), requires_grad=False)})
    p = nn.Parameter(torch.randn(2))
    p.tag = "embedding"
    p.scale = 0.5
    save("parameter_with_state", {"p": p})
    save("requires_grad", {"t": torch.randn(3, requires_grad=True)})
    t = torch.arange(6.0).reshape(2, 3)
    t._has_been_cloned = True
    t.note = {"k": [1, 2]}
    save("tensor_attributes", collections.OrderedDict(w=t))
    save("module", {"model": Net().state_dict(), "params": list(Net().parameters())})

    # Complex values.
    save("complex64", {"c": torch.randn(3, dtype=torch.complex64), "z": 1.5 - 2j})
    save("complex128", {"c": torch.randn(2, 2, dtype=torch.complex128)})

    # Sparse layouts.
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 3.0]])
    save("sparse_coo", {"s": dense.to_sparse()})
    unco = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [2, 1, 2]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    save("sparse_coo_uncoalesced", {"s": unco, "hybrid": torch.randn(3, 2).to_sparse(1)})
    save("sparse_csr", {"s": dense.to_sparse_csr()})
    save("sparse_csc", {"s": dense.to_sparse_csc()})
    blocks = torch.arange(16.0).reshape(4, 4) * (torch.arange(4) % 2 == 0).float().reshape(4, 1)
    save("sparse_bsr", {"s": blocks.to_sparse_bsr((2, 2))})
    save("sparse_bsc", {"s": blocks.to_sparse_bsc((2, 2))})

    # Quantized tensors.
    x = torch.tensor([[-1.0, 0.5, 2.0], [3.0, -0.25, 1.0]])
    save(
        "quantized_per_tensor",
        {
            "qint8": torch.quantize_per_tensor(x, 0.1, 3, torch.qint8),
            "quint8": torch.quantize_per_tensor(x, 0.05, 10, torch.quint8),
            "qint32": torch.quantize_per_tensor(x, 0.001, -4, torch.qint32),
        },
    )
    save(
        "quantized_per_channel",
        {
            "q": torch.quantize_per_channel(x, torch.tensor([0.1, 0.2]), torch.tensor([1, -2]), 0, torch.qint8),
            "float_qparams": torch.quantize_per_channel(
                x, torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 1.0, 0.0]), 1, torch.quint8
            ),
        },
    )

    # Meta tensors and values of the allow-list.
    save("meta", {"m": torch.empty(2, 3, device="meta"), "t": torch.empty(4, 2, device="meta").t()})
    save(
        "values",
        {
            "set": {3, 1, 2},
            "bytearray": bytearray(b"\x00ab\xff"),
            "counter": collections.Counter("abracadabra"),
            "device": torch.device("cuda", 1),
            "cpu": torch.device("cpu"),
            "dtype": torch.bfloat16,
            "shell_dtype": torch.uint4,
            "layout": torch.sparse_coo,
            "qscheme": torch.per_channel_affine,
        },
    )

    # The legacy (pre-1.6) format.
    save(
        "legacy_format",
        {"w": torch.randn(2, 3), "step": 7, "odict": collections.OrderedDict(a=torch.arange(3))},
        _use_new_zipfile_serialization=False,
    )

    save("parameter_newobj", {"p": NewObjParameter(torch.randn(3))})

    # Refused by both: opcodes of later pickle protocols (bytes, framing), which the
    # weights_only unpickler does not execute.
    save("protocol_3_bytes", {"b": b"abc", "t": torch.ones(2)}, pickle_protocol=3)
    save("protocol_4", {"t": torch.ones(2), "name": "x" * 10}, pickle_protocol=4)
    # Refused by both: a global outside the allow-list.
    save("refused_custom_class", {"opt": Opt(0.1)})
    # Read by weights_only, refused by the crate by name (see expected.json).
    save("nested_tensor", {"n": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])})


if __name__ == "__main__":
    main()

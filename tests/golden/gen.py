"""Golden fixtures from REAL PyTorch 2.13 FSDP for `tests/it/golden_fsdp.rs`.

Run manually (the Rust tests never run Python) from the crate root, with the project's venv,
and commit the output:

    .venv/bin/python tests/golden/gen.py            # every scenario
    .venv/bin/python tests/golden/gen.py nested_ws2 # only the named scenarios

It spawns the ranks of each scenario with `torch.multiprocessing` on 127.0.0.1 (a free port),
`gloo` backend, FSDP with `device_id=torch.device("cpu")`, and writes
`tests/golden/fsdp/<scenario>/`:

* `desc.json` — the model (`ModelDesc`: primary names in `named_parameters()` order, shapes,
  dtypes, `requires_grad`, tied aliases alias -> primary), the policy (`WrapPolicy`: FSDP
  units as module prefixes, ignored modules, `use_orig_params`, sharding strategy), the world
  size, the optimizer and its param-group overrides, and for every rank the optimizer input
  as the crate's `OptimParams` (`{"Flat": unit}` for a flat parameter, `{"Param": name}` for an
  original one); the same for each `load` target (another world size and/or wrapping).
* `params.pt` — `{name: initial full tensor}` (primary names).
* `grads.pt` — `[{name: full gradient}]` per step (trained parameters only, minus a
  scenario's `no_grad` list: unused parameters). Gradients are set explicitly, not computed
  by autograd: every rank cuts the same full gradient into its local shard exactly as FSDP
  lays out the flat parameter (`_numels_with_padding`, `FlatParamHandle._get_shard`), so no
  reduce-scatter (and no world-size dependent division) is involved.
* `rank<r>.pt` — a dict of this rank's inputs and PyTorch's outputs:
  - `params0`: the local optimizer tensors before the first step (by optimizer id),
  - `grads`: per step, the local gradients as set (by optimizer id, `None` = no gradient),
  - `local`: per step, `optim.state_dict()` after the step,
  - `params_final`: the local optimizer tensors after the last step,
  - `full`: `FSDP.full_optim_state_dict(model, optim, rank0_only=False)`,
  - `full_rank0`: the same with `rank0_only=True` (`{}` on ranks other than 0),
  - `sharded`: `FSDP.sharded_optim_state_dict(model, optim)` with every `ShardedTensor`
    replaced by the tuple `("ShardedTensor", global_shape, offsets, local)` (`local` is this
    rank's one local shard tensor or `None` when it has none) because the crate's reader takes
    no `ShardedTensor` pickles,
  - `osd_full`: `FSDP.optim_state_dict(model, optim)` under `FULL_STATE_DICT` (default config:
    `offload_to_cpu=True`, `rank0_only=False`),
  - `osd_full_rank0`: the same with `FullOptimStateDictConfig(rank0_only=True)`,
  - `rekey_full_to_ids`: `FSDP.rekey_optim_state_dict(full, PARAM_ID, plain, optim=plain_optim)`
    where `plain` is the model without FSDP and `plain_optim` its optimizer built from the same
    input structure (PyTorch's rekeying maps by `named_parameters()` of a model without flat
    parameters; `plain_optim_params` records that input),
  - `rekey_ids_to_names`: that dict rekeyed back with `PARAM_NAME`,
  - `to_load_same`: `FSDP.optim_state_dict_to_load(model, fresh optim, full)` (same config),
  - `flatten_sharded`: `FSDP.flatten_sharded_optim_state_dict(sharded, model, fresh optim)`,
  - `custom_local`: the last `local` dict with `value1=2.74` and `value2=None` added to every
    parameter's state (PyTorch's `test_state_dict_with_none_tensor_state`), `osd_custom`:
    `FSDP.optim_state_dict(model, optim, optim_state_dict=custom_local)` (FULL, default
    config), `to_load_custom`: `FSDP.optim_state_dict_to_load(model, fresh optim, osd_custom)`
    (rank-0-only loading of such a dict crashes PyTorch on rank 0 and hangs the others, so it
    is not generated),
  - `osd_sharded`: `FSDP.optim_state_dict(model, optim)` under `SHARDED_STATE_DICT` (same
    tuple form as `sharded`), `to_load_sharded`: `FSDP.optim_state_dict_to_load(model, fresh
    optim, that sharded dict)`.
* `load_<name>/rank<r>.pt` — for a load target (another world size / wrapping, fresh model and
  optimizer built by the target's input), from this scenario's `full` dict of rank 0:
  `shard_full` (`FSDP.shard_full_optim_state_dict(full, model, optim=optim)`), `scatter_full`
  (`FSDP.scatter_full_optim_state_dict(full on rank 0 / None, model, optim=optim)`), `to_load`
  (`FSDP.optim_state_dict_to_load(model, optim, full)`), `to_load_rank0` (the same under
  `FullOptimStateDictConfig(rank0_only=True)`, rank 0 passing the dict, the others `None`).

Deterministic: parameters come from `torch.manual_seed` at model construction, gradients
from a seeded `torch.Generator`; everything runs single-threaded (`torch.set_num_threads(1)`).
The ranks run with `PYTHONHASHSEED=0`, which fixes the order PyTorch gives a loaded flat
parameter's state names (it iterates a `set`). Re-running rewrites identical contents (the
zip's random `serialization_id` record differs).
"""

import json
import os
import shutil
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateKeyType, ShardingStrategy, StateDictType
from torch.distributed.fsdp._common_utils import clean_tensor_name

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fsdp")
STEPS = 3


# ---------------------------------------------------------------- models (test_fsdp_optim_state.py)
class Bias(nn.Module):
    def __init__(self, dim):
        super().__init__()
        torch.manual_seed(0)
        self.bias = nn.Parameter(torch.randn((dim,)))


class BlockA(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        torch.manual_seed(0)
        self.bias_module0 = Bias(out_dim)
        self.weight = nn.Parameter(torch.randn((in_dim, out_dim)))
        self.bias_module1 = Bias(out_dim)


class BlockB(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn((in_dim, out_dim)))
        self.bias_module0 = Bias(out_dim)
        self.bias_module1 = Bias(out_dim)


class NestedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block0 = BlockB(5, 3)
        self.block1 = BlockB(3, 7)
        self.bias = nn.Parameter(torch.randn((5,)))
        self.block2 = nn.Sequential(BlockA(7, 9), BlockA(9, 9), BlockB(9, 5))

    def param_groups(self):
        # `param_group0` / `param_group1` of the PyTorch test.
        return [list(self.block1.parameters()), list(self.block2.parameters()) + list(self.block0.parameters())]


class Layer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.linear1 = nn.Linear(d, h)
        self.linear2 = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)


class TiedTransformer(nn.Module):
    """Transformer-like: an embedding tied to the output projection, two layers."""

    def __init__(self, vocab=11, d=4, h=6):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Layer(d, h) for _ in range(2)])
        self.output_proj = nn.Linear(d, vocab)
        self.output_proj.weight = self.embed_tokens.weight


class DummyModel(nn.Module):
    """`TestDummyModel` of the PyTorch test, smaller, `net1` optionally frozen."""

    def __init__(self, frozen_first):
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
        self.net3 = nn.Linear(5, 7)
        self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(7, 3))
        if frozen_first:
            for p in self.net1.parameters():
                p.requires_grad_(False)


def build_model(kind):
    if kind == "nested":
        return NestedModel()
    if kind == "tied":
        return TiedTransformer()
    if kind == "dummy_frozen":
        return DummyModel(frozen_first=True)
    if kind == "dummy_bf16":
        return DummyModel(frozen_first=False).to(torch.bfloat16)
    raise ValueError(kind)


# Wrapping policies: FSDP units (module prefixes, innermost first as FSDP wraps them),
# ignored modules (per unit that receives them).
POLICIES = {
    # NestedModel.wrap(ignore_modules=True)
    "wrap_ignored": {
        "units": ["block1.bias_module0", "block1", "block2.1.bias_module0", "block2.1.bias_module1", "block2.1", "block2.2"],
        "ignored": {"block2.2": ["block2.2.bias_module0"]},
    },
    # NestedModel.wrap()
    "wrap": {
        "units": ["block1.bias_module0", "block1", "block2.1.bias_module0", "block2.1.bias_module1", "block2.1", "block2.2"],
        "ignored": {},
    },
    # NestedModel.wrap_alt()
    "wrap_alt": {"units": ["block0.bias_module0", "block0"], "ignored": {}},
    "tied_layers_root": {"units": ["layers.0", "layers.1", ""], "ignored": {}},
    "dummy_net1_net3_root": {"units": ["net1", "net3", ""], "ignored": {}},
    "dummy_root": {"units": [""], "ignored": {}},
}

SCENARIOS = {
    # Nested model, `wrap` with an ignored module, two param groups (weight_decay 0.9 on the
    # second), optimizer input reversed on odd ranks; loaded into world size 3 with `wrap_alt`.
    "nested_ws2": {
        "model": "nested",
        "policy": "wrap_ignored",
        "ws": 2,
        "optim": "Adam",
        "groups": True,
        "diff_inputs": True,
        "loads": {"ws3_wrap_alt": {"policy": "wrap_alt", "ws": 3, "groups": False, "diff_inputs": False}},
    },
    # Nested model, `wrap_alt`, world size 3 (odd), AdamW, one group; loaded into world
    # size 2 with `wrap`, the optimizer input reversed on odd ranks. (Loading it into the two
    # groups of the PyTorch test fails in PyTorch: they leave out the root's `bias`.)
    "nested_alt_ws3": {
        "model": "nested",
        "policy": "wrap_alt",
        "ws": 3,
        "optim": "AdamW",
        "groups": False,
        "diff_inputs": False,
        "loads": {"ws2_wrap_reversed": {"policy": "wrap", "ws": 2, "groups": False, "diff_inputs": True}},
    },
    # Tied weights; loaded into world size 3.
    "tied_ws2": {
        "model": "tied",
        "policy": "tied_layers_root",
        "ws": 2,
        "optim": "Adam",
        "groups": False,
        "diff_inputs": False,
        "loads": {"ws3": {"policy": "tied_layers_root", "ws": 3, "groups": False, "diff_inputs": False}},
    },
    # use_orig_params=True with a frozen sub-module, world size 3 (params with no element on
    # some ranks); loaded into world size 2 wrapped at the root only.
    "orig_params_ws3": {
        "model": "dummy_frozen",
        "policy": "dummy_net1_net3_root",
        "ws": 3,
        "optim": "Adam",
        "use_orig_params": True,
        "groups": False,
        "diff_inputs": False,
        "loads": {"ws2_root": {"policy": "dummy_root", "ws": 2, "groups": False, "diff_inputs": False}},
    },
    # bf16 parameters with use_orig_params=True (alignment padding of 8 elements); loaded into
    # NO_SHARD at world size 3.
    "orig_params_bf16_ws2": {
        "model": "dummy_bf16",
        "policy": "dummy_net1_net3_root",
        "ws": 2,
        "optim": "Adam",
        "use_orig_params": True,
        "groups": False,
        "diff_inputs": False,
        "loads": {"ws3_no_shard": {"policy": "dummy_net1_net3_root", "ws": 3, "strategy": "NO_SHARD", "groups": False, "diff_inputs": False}},
    },
    # HYBRID_SHARD over 4 ranks (shard groups {0,1} and {2,3}); loaded into FULL_SHARD at
    # world size 2.
    "hybrid_ws4": {
        "model": "nested",
        "policy": "wrap",
        "ws": 4,
        "optim": "Adam",
        "strategy": "HYBRID_SHARD",
        "groups": False,
        "diff_inputs": False,
        "loads": {"ws2_full_shard": {"policy": "wrap", "ws": 2, "strategy": "FULL_SHARD", "groups": False, "diff_inputs": False}},
    },
    # Unused parameters (no gradient ever): an unmanaged one, one alone in its flat parameter
    # (no state at all) and one sharing a flat parameter (state from zero gradients); loaded
    # into world size 3 with `wrap_alt`.
    "unused_params_ws2": {
        "model": "nested",
        "policy": "wrap",
        "ws": 2,
        "optim": "Adam",
        "groups": False,
        "diff_inputs": False,
        "no_grad": ["block0.weight", "block1.bias_module0.bias", "block2.2.weight"],
        "loads": {"ws3_wrap_alt": {"policy": "wrap_alt", "ws": 3, "groups": False, "diff_inputs": False}},
    },
    # use_orig_params=True with a whole unit unused (`net3`: its flat parameter has no state on
    # any rank). A trained parameter without state beside members with state is an error in
    # PyTorch ("... is not in the optimizer state"), so it has no fixture.
    "orig_unused_ws2": {
        "model": "dummy_frozen",
        "policy": "dummy_net1_net3_root",
        "ws": 2,
        "optim": "Adam",
        "use_orig_params": True,
        "groups": False,
        "diff_inputs": False,
        "no_grad": ["net3.weight", "net3.bias"],
        "loads": {"ws3_root": {"policy": "dummy_root", "ws": 3, "groups": False, "diff_inputs": False}},
    },
    # NO_SHARD with SGD momentum; loaded into FULL_SHARD at world size 3.
    "no_shard_ws2": {
        "model": "nested",
        "policy": "wrap",
        "ws": 2,
        "optim": "SGD",
        "strategy": "NO_SHARD",
        "groups": False,
        "diff_inputs": False,
        "loads": {"ws3_full_shard": {"policy": "wrap", "ws": 3, "strategy": "FULL_SHARD", "groups": False, "diff_inputs": False}},
    },
}


# ---------------------------------------------------------------- helpers
DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
DTYPE_OF = {v: k for k, v in DTYPES.items()}

def model_desc(model):
    params, tied, seen = [], {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied[name] = seen[id(p)]
            continue
        seen[id(p)] = name
        dtype = DTYPES[p.dtype]
        params.append({"name": name, "shape": list(p.shape), "dtype": dtype, "requires_grad": p.requires_grad})
    return {"params": params, "tied": tied}


def get_module(model, prefix):
    return model.get_submodule(prefix) if prefix else model


def set_module(model, prefix, new):
    parent, _, leaf = prefix.rpartition(".")
    setattr(get_module(model, parent), leaf, new)


HYBRID_SHARD_GROUP = 2


def hybrid_groups():
    """(shard group, replicate group) of this rank: consecutive pairs shard, strided ranks
    replicate. Every rank creates every group, in the same order, as `new_group` requires."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    mine = [None, None]
    for g in range(ws // HYBRID_SHARD_GROUP):
        pg = dist.new_group(list(range(g * HYBRID_SHARD_GROUP, (g + 1) * HYBRID_SHARD_GROUP)))
        if rank // HYBRID_SHARD_GROUP == g:
            mine[0] = pg
    for i in range(HYBRID_SHARD_GROUP):
        pg = dist.new_group(list(range(i, ws, HYBRID_SHARD_GROUP)))
        if rank % HYBRID_SHARD_GROUP == i:
            mine[1] = pg
    return tuple(mine)


def wrap_model(model, policy_name, use_orig_params, strategy):
    pol = POLICIES[policy_name]
    extra = {"process_group": hybrid_groups()} if strategy == "HYBRID_SHARD" else {}
    for unit in pol["units"]:
        module = get_module(model, unit)
        ignored = [get_module(model, m) for m in pol["ignored"].get(unit, [])] or None
        wrapped = FSDP(
            module,
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
            sharding_strategy=ShardingStrategy[strategy],
            ignored_modules=ignored,
            **extra,
        )
        if unit:
            set_module(model, unit, wrapped)
        else:
            model = wrapped
    return model


def policy_json(policy_name, use_orig_params, strategy):
    pol = POLICIES[policy_name]
    return {
        "units": pol["units"],
        "ignored_modules": [m for ms in pol["ignored"].values() for m in ms],
        "use_orig_params": use_orig_params,
        "sharding_strategy": strategy,
    }


def optim_input(model, groups, diff_inputs, rank):
    if groups:
        inp = [{"params": g} for g in model.param_groups()]
        inp[1]["weight_decay"] = 0.9
        if diff_inputs and rank % 2 == 1:
            for g in inp:
                g["params"] = list(reversed(g["params"]))
    else:
        inp = list(model.parameters())
        if diff_inputs and rank % 2 == 1:
            inp = list(reversed(inp))
    return inp


def make_optim(kind, inp):
    if kind == "Adam":
        return torch.optim.Adam(inp, lr=0.01)
    if kind == "AdamW":
        return torch.optim.AdamW(inp, lr=0.01)
    if kind == "SGD":
        return torch.optim.SGD(inp, lr=0.01, momentum=0.9)
    raise ValueError(kind)


def param_names(model):
    """id(param) -> the crate's OptimParam of the wrapped model's parameters."""
    out = {}
    for name, p in model.named_parameters():
        name = clean_tensor_name(name)
        if name == "_flat_param" or name.endswith("._flat_param"):
            out[id(p)] = {"Flat": name[: -len("_flat_param")].rstrip(".")}
        else:
            out[id(p)] = {"Param": name}
    return out


def optim_params_json(model, optim):
    names = param_names(model)
    return {"groups": [[names[id(p)] for p in g["params"]] for g in optim.param_groups], "named": False}


def handles(model):
    """(module prefix, flat_param) of every FSDP unit with a flat parameter."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FSDP) and m._handle is not None:
            out.append((clean_tensor_name(name), m._handle))
    return out


def set_grads(model, full_grads, tied, use_orig_params):
    """Cuts the full gradients into every local optimizer tensor, as FSDP lays them out.

    A parameter missing from `full_grads` (frozen or unused) gets no gradient: with
    `use_orig_params` its view's `.grad` stays `None`; a flat parameter none of whose members
    has a gradient gets none either, otherwise the missing members are zeros in its gradient.
    """
    managed = set()
    for prefix, h in handles(model):
        fp = h.flat_param
        names = [tied.get(n, n) for n in (f"{prefix}.{q}" if prefix else q for q in fp._fqns)]
        managed.update(names)
        grads = [full_grads.get(n) for n in names]
        if all(g is None for g in grads):
            for p in fp._params if use_orig_params else [fp]:
                p.grad = None
            continue
        members = iter(grads)
        pieces = []
        for numel, is_pad in zip(fp._numels_with_padding, fp._is_padding_mask):
            g = None if is_pad else next(members)
            pieces.append(torch.zeros(numel, dtype=fp.dtype) if g is None else g.reshape(-1))
        flat = torch.cat(pieces)
        shard = h._get_shard(flat, h.rank, h.world_size)[0] if h.uses_sharded_strategy else flat
        assert shard.shape == fp.shape, (prefix, shard.shape, fp.shape)
        if not use_orig_params:
            fp.grad = shard.clone()
            continue
        for p, info, g in zip(fp._params, fp._shard_param_infos, grads):
            if g is not None and info.in_shard:
                p.grad = shard[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard].clone()
            else:
                p.grad = None
    for name, p in model.named_parameters():
        name = clean_tensor_name(name)
        if name.endswith("_flat_param") or name in managed:
            continue
        g = full_grads.get(name)
        p.grad = None if g is None else g.clone()


def local_tensors(optim):
    return [p.detach().clone() for g in optim.param_groups for p in g["params"]]


def local_grads(optim):
    return [None if p.grad is None else p.grad.detach().clone() for g in optim.param_groups for p in g["params"]]


def plain_sharded(osd):
    """ShardedTensor values -> ("ShardedTensor", global_shape, offsets, local or None)."""
    state = {}
    for k, st in osd["state"].items():
        new = {}
        for n, v in st.items():
            if isinstance(v, ShardedTensor):
                shards = v.local_shards()
                assert len(shards) <= 1
                if shards:
                    local = shards[0].tensor.detach().clone()
                    offsets = tuple(shards[0].metadata.shard_offsets)
                else:
                    local, offsets = None, None
                new[n] = ("ShardedTensor", tuple(v.size()), offsets, local)
            else:
                new[n] = v
        state[k] = new
    return {"state": state, "param_groups": osd["param_groups"]}


def snapshot(obj):
    """Deep copy (tensors cloned) so later steps cannot alias saved state.

    A `torch.dtype` (PyTorch leaves `(shape, dtype)` placeholders in some loaded dicts, see
    `unused_params_ws2`) becomes its name, e.g. `"torch.float32"`: the crate's reader, like
    `weights_only`, takes no dtype objects.
    """
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    return obj


def init_pg(rank, ws, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=ws)


# ---------------------------------------------------------------- one scenario, one rank
def run_rank(rank, ws, port, cfg, out_dir):
    init_pg(rank, ws, port)
    try:
        unwrapped = build_model(cfg["model"])
        desc = model_desc(unwrapped)
        tied = desc["tied"]
        model = wrap_model(unwrapped, cfg["policy"], cfg.get("use_orig_params", False), cfg.get("strategy", "FULL_SHARD"))
        inp = optim_input(model, cfg["groups"], cfg["diff_inputs"], rank)
        optim = make_optim(cfg["optim"], inp)
        grads_all = torch.load(os.path.join(out_dir, "grads.pt"))
        rec = {"params0": local_tensors(optim), "grads": [], "local": []}
        for s in range(STEPS):
            set_grads(model, grads_all[s], tied, cfg.get("use_orig_params", False))
            rec["grads"].append(local_grads(optim))
            optim.step()
            rec["local"].append(snapshot(optim.state_dict()))
        rec["params_final"] = local_tensors(optim)
        rec["full"] = snapshot(FSDP.full_optim_state_dict(model, optim, rank0_only=False))
        rec["full_rank0"] = snapshot(FSDP.full_optim_state_dict(model, optim, rank0_only=True))
        sharded = FSDP.sharded_optim_state_dict(model, optim)
        rec["sharded"] = plain_sharded(sharded)
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
        rec["osd_full"] = snapshot(FSDP.optim_state_dict(model, optim))
        FSDP.set_state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=True),
            FullOptimStateDictConfig(rank0_only=True),
        )
        rec["osd_full_rank0"] = snapshot(FSDP.optim_state_dict(model, optim))
        # Rekeying takes a model without FSDP and its optimizer (same input structure).
        plain = build_model(cfg["model"])
        plain_optim = make_optim(cfg["optim"], optim_input(plain, cfg["groups"], cfg["diff_inputs"], rank))
        rec["plain_optim_params"] = json.dumps(optim_params_json(plain, plain_optim))
        to_ids = FSDP.rekey_optim_state_dict(rec["full"], OptimStateKeyType.PARAM_ID, plain, optim=plain_optim)
        rec["rekey_full_to_ids"] = snapshot(to_ids)
        rec["rekey_ids_to_names"] = snapshot(FSDP.rekey_optim_state_dict(to_ids, OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim))
        # Loading into the same configuration (fresh optimizer over the same input).
        fresh = make_optim(cfg["optim"], optim_input(model, cfg["groups"], cfg["diff_inputs"], rank))
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
        rec["to_load_same"] = snapshot(FSDP.optim_state_dict_to_load(model, fresh, rec["full"]))
        rec["flatten_sharded"] = snapshot(FSDP.flatten_sharded_optim_state_dict(sharded, model, fresh))
        # Custom non-tensor state (`test_state_dict_with_none_tensor_state`).
        custom = snapshot(rec["local"][-1])
        for st in custom["state"].values():
            st["value1"] = 2.74
            st["value2"] = None
        rec["custom_local"] = custom
        rec["osd_custom"] = snapshot(FSDP.optim_state_dict(model, optim, optim_state_dict=snapshot(custom)))
        rec["to_load_custom"] = snapshot(FSDP.optim_state_dict_to_load(model, fresh, rec["osd_custom"]))
        # SHARDED_STATE_DICT through the state-dict-type API.
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        osd_sharded = FSDP.optim_state_dict(model, optim)
        rec["osd_sharded"] = plain_sharded(osd_sharded)
        rec["to_load_sharded"] = snapshot(FSDP.optim_state_dict_to_load(model, fresh, osd_sharded))
        rec["optim_params"] = json.dumps(optim_params_json(model, optim))
        torch.save(rec, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def load_rank(rank, ws, port, cfg, lcfg, out_dir, load_dir):
    init_pg(rank, ws, port)
    try:
        full = torch.load(os.path.join(out_dir, "rank0.pt"))["full"]
        c = dict(cfg)
        c.update(lcfg)
        model = wrap_model(build_model(cfg["model"]), lcfg["policy"], c.get("use_orig_params", False), c.get("strategy", "FULL_SHARD"))
        optim = make_optim(cfg["optim"], optim_input(model, lcfg["groups"], lcfg["diff_inputs"], rank))
        rec = {
            "shard_full": snapshot(FSDP.shard_full_optim_state_dict(full, model, optim=optim)),
            "scatter_full": snapshot(FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, model, optim=optim)),
        }
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
        rec["to_load"] = snapshot(FSDP.optim_state_dict_to_load(model, optim, full))
        FSDP.set_state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=True),
            FullOptimStateDictConfig(rank0_only=True),
        )
        rec["to_load_rank0"] = snapshot(FSDP.optim_state_dict_to_load(model, optim, full if rank == 0 else None))
        rec["optim_params"] = json.dumps(optim_params_json(model, optim))
        torch.save(rec, os.path.join(load_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, ws, *args):
    mp.spawn(fn, args=(ws, free_port()) + args, nprocs=ws, join=True)


def generate(name, cfg):
    out_dir = os.path.join(OUT, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    model = build_model(cfg["model"])
    desc = model_desc(model)
    torch.save({p["name"]: t.detach().clone() for p, t in zip(desc["params"], dict(model.named_parameters()).values())}, os.path.join(out_dir, "params.pt"))
    gen = torch.Generator().manual_seed(1234)
    grads = []
    for _ in range(STEPS):
        # Frozen parameters get no gradient, as in training.
        grads.append(
            {
                p["name"]: torch.randn(p["shape"], generator=gen).to(DTYPE_OF[p["dtype"]])
                for p in desc["params"]
                if p["requires_grad"] and p["name"] not in cfg.get("no_grad", ())
            }
        )
    torch.save(grads, os.path.join(out_dir, "grads.pt"))
    spawn(run_rank, cfg["ws"], cfg, out_dir)
    loads = {}
    for lname, lcfg in cfg.get("loads", {}).items():
        load_dir = os.path.join(out_dir, f"load_{lname}")
        os.makedirs(load_dir)
        spawn(load_rank, lcfg["ws"], cfg, lcfg, out_dir, load_dir)
        c = dict(cfg)
        c.update(lcfg)
        loads[lname] = {
            "policy": policy_json(lcfg["policy"], c.get("use_orig_params", False), c.get("strategy", "FULL_SHARD")),
            "world_size": lcfg["ws"],
        }
    meta = {
        "torch_version": torch.__version__,
        "model": desc,
        "policy": policy_json(cfg["policy"], cfg.get("use_orig_params", False), cfg.get("strategy", "FULL_SHARD")),
        "world_size": cfg["ws"],
        "shard_group_size": HYBRID_SHARD_GROUP if cfg.get("strategy") == "HYBRID_SHARD" else cfg["ws"],
        "optimizer": cfg["optim"],
        "optimizer_kwargs": {"Adam": {"lr": 0.01}, "AdamW": {"lr": 0.01}, "SGD": {"lr": 0.01, "momentum": 0.9}}[cfg["optim"]],
        # Per param group, the options given beside `params` (the rest are the kwargs).
        "group_overrides": [{}, {"weight_decay": 0.9}] if cfg["groups"] else [{}],
        "diff_inputs": cfg["diff_inputs"],
        "steps": STEPS,
        "loads": loads,
    }
    with open(os.path.join(out_dir, "desc.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{name}: done")


def main():
    # Spawned ranks are fresh interpreters that inherit the environment: a fixed hash seed makes
    # PyTorch's set-ordered state names (loading a flat parameter) the same on every run.
    os.environ["PYTHONHASHSEED"] = "0"
    names = sys.argv[1:] or list(SCENARIOS)
    for n in names:
        generate(n, SCENARIOS[n])


if __name__ == "__main__":
    main()

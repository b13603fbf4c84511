"""``DESC.json`` from a live model: the description ``consolidate_torch``, ``shard_torch`` and
``convert(..., to="fsdp")`` need, read off an FSDP1- or FSDP2-wrapped model instead of written
by hand.

A description holds:

* ``model``: every unique parameter under its first name in ``named_parameters()`` order of
  the unwrapped model (names without FSDP's wrapper prefixes), with its full shape, dtype and
  ``requires_grad``, and ``tied``: alias name -> first name;
* ``policy``: the FSDP units (module prefixes, ``""`` is the root) in the order FSDP applies
  them (innermost first), the ignored modules, ``use_orig_params`` and the sharding strategy
  (FSDP1), or ``"fsdp_version": 2`` (FSDP2, ``fully_shard``);
* with an optimizer, the parameters of each of its param groups as the crate names them:
  ``{"Flat": unit}`` for an FSDP1 flat parameter, ``{"Param": name}`` for an original one.

It needs PyTorch; nothing here reads or changes tensor data.
"""

import json
import os
import tempfile
from typing import Any, Dict, List, Optional

__all__ = ["describe", "write_desc"]

_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "bool": "bool",
}


def _dtype(t) -> str:
    name = str(t).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"parameter dtype {t} has no counterpart in the fsdp crate")
    return _DTYPES[name]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _clean(name: str) -> str:
    """A parameter name without FSDP's wrapper prefixes."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _clean_module(name: str) -> str:
    """A module name without FSDP's wrapper prefixes (also a trailing one: a wrapped module's
    own name ends with ``_fsdp_wrapped_module``)."""
    return _clean(name + ".")[:-1] if name else ""


def _is_fsdp1(m) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(m, FullyShardedDataParallel)


def _is_fsdp2(m) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(m, FSDPModule)


def _modules(root):
    """``(clean name, module)`` of every module but FSDP1 wrappers, in pre-order, each once."""
    seen, out = set(), []
    for name, m in root.named_modules():
        if _is_fsdp1(m) or id(m) in seen:
            continue
        seen.add(id(m))
        out.append((_clean_module(name), m))
    return out


def _post_order_units(root, is_unit) -> List[str]:
    """Clean names of the modules ``is_unit`` accepts, children before their parent."""
    out: List[str] = []

    def walk(prefix: str, m) -> None:
        for child_name, child in m.named_children():
            walk(_join(prefix, child_name), child)
        if is_unit(m):
            out.append(_clean_module(prefix))

    walk("", root)
    return out


def _param(name: str, shape, dtype, requires_grad: bool) -> Dict[str, Any]:
    return {
        "name": name,
        "shape": [int(d) for d in shape],
        "dtype": _dtype(dtype),
        "requires_grad": bool(requires_grad),
    }


def _fsdp1_handles(root):
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [
        m._handle
        for m in root.modules()
        if isinstance(m, FullyShardedDataParallel) and m._handle is not None
    ]


def _fsdp1_model(root, modules) -> Dict[str, Any]:
    """FSDP1: flat parameters hide the original ones; their metadata names them."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    names = {id(m): n for n, m in modules}
    managed: Dict[int, List[Dict[str, Any]]] = {}
    tied: Dict[str, str] = {}
    for handle in _fsdp1_handles(root):
        fp = handle.flat_param
        for i, info in enumerate(fp._param_infos):
            rg = fp._params[i].requires_grad if fp._params is not None else fp.requires_grad
            name = _join(names[id(info.module)], info.param_name)
            managed.setdefault(id(info.module), []).append(
                _param(name, fp._shapes[i], fp.dtype, rg)
            )
        for s in fp._shared_param_infos:
            alias = _join(names[id(s.module)], s.param_name)
            tied[alias] = _join(names[id(s.prim_module)], s.prim_param_name)
    params, first_name = [], {}
    for prefix, m in modules:
        if id(m) in managed:
            params.extend(managed[id(m)])
            continue
        # Modules FSDP does not manage (ignored ones, or outside every unit) keep their
        # parameters as they are.
        for pname, p in m._parameters.items():
            if p is None or isinstance(p, FlatParameter):
                continue
            name = _join(prefix, pname)
            if id(p) in first_name:
                tied[name] = first_name[id(p)]
                continue
            first_name[id(p)] = name
            params.append(_param(name, p.shape, p.dtype, p.requires_grad))
    return {"params": params, "tied": tied}


def _fsdp1_policy(root, modules) -> Dict[str, Any]:
    fsdp = [m for m in root.modules() if _is_fsdp1(m)]
    ignored = set()
    for m in fsdp:
        ignored |= {id(x) for x in m._ignored_modules}
    # FSDP records each ignored module's whole subtree; the policy names the subtree roots.
    parent = {}
    for prefix, m in modules:
        for _, c in m.named_children():
            parent.setdefault(id(c), id(m))
    roots = [
        prefix for prefix, m in modules if id(m) in ignored and parent.get(id(m)) not in ignored
    ]
    return {
        "units": _post_order_units(root, _is_fsdp1),
        "ignored_modules": roots,
        "use_orig_params": bool(fsdp[0]._use_orig_params),
        "sharding_strategy": fsdp[0].sharding_strategy.name,
    }


def _fsdp1_optim_names(root) -> Dict[int, Dict[str, str]]:
    out = {}
    for name, p in root.named_parameters():
        name = _clean(name)
        if name == "_flat_param" or name.endswith("._flat_param"):
            out[id(p)] = {"Flat": name[: -len("_flat_param")].rstrip(".")}
        else:
            out[id(p)] = {"Param": name}
    return out


def _fsdp2_model(root) -> Dict[str, Any]:
    """FSDP2: parameters keep their names; a sharded one is a DTensor of the full shape."""
    params, tied, first_name = [], {}, {}
    for name, p in root.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied[name] = first_name[id(p)]
            continue
        first_name[id(p)] = name
        params.append(_param(name, p.shape, p.dtype, p.requires_grad))
    return {"params": params, "tied": tied}


def _fsdp2_policy(root) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    # Parameters `fully_shard` left as plain tensors (its `ignored_params`): the policy names
    # the largest modules all of whose parameters are such.
    def unmanaged(m) -> bool:
        ps = list(m.parameters())
        return bool(ps) and not any(isinstance(p, DTensor) for p in ps)

    ignored: List[str] = []

    def walk(prefix: str, m) -> None:
        if unmanaged(m) and prefix:
            ignored.append(prefix)
            return
        for child_name, child in m.named_children():
            walk(_join(prefix, child_name), child)

    walk("", root)
    return {"units": _post_order_units(root, _is_fsdp2), "fsdp_version": 2, "ignored_modules": ignored}


def _optim_groups(optim, names: Dict[int, Dict[str, str]]) -> Dict[str, Any]:
    groups = []
    for g, group in enumerate(optim.param_groups):
        row = []
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"param group {g} of the optimizer holds a tensor (index {i}, shape "
                    f"{tuple(p.shape)}) that is not a parameter of the model"
                )
            row.append(names[id(p)])
        groups.append(row)
    return {"groups": groups, "named": False}


def describe(model, optim=None) -> Dict[str, Any]:
    """The DESC.json of an FSDP1- or FSDP2-wrapped ``model``, as a dict, on this rank.

    ``model`` is the root module as training holds it: wrapped with
    ``FullyShardedDataParallel`` (any ``use_orig_params``, nested units, ignored modules,
    sharding strategy) or with ``fully_shard`` on some of its modules. With ``optim``, the
    dict also has ``optim_params``: this rank's param groups, which may differ between ranks;
    :func:`write_desc` gathers every rank's. FSDP2 units are listed children before parents,
    the order in which ``fully_shard`` is normally applied.

    Raises ``ValueError`` for a model without FSDP units, a parameter dtype the crate does
    not know, or an optimizer holding a tensor that is not one of the model's parameters.
    """
    if any(_is_fsdp1(m) for m in model.modules()):
        modules = _modules(model)
        desc = {"model": _fsdp1_model(model, modules), "policy": _fsdp1_policy(model, modules)}
        names = _fsdp1_optim_names(model)
    elif any(_is_fsdp2(m) for m in model.modules()):
        desc = {"model": _fsdp2_model(model), "policy": _fsdp2_policy(model)}
        names = {id(p): {"Param": n} for n, p in model.named_parameters()}
    else:
        raise ValueError(
            "the model has no FSDP units: wrap it with FullyShardedDataParallel or fully_shard first"
        )
    if optim is not None:
        desc["optim_params"] = _optim_groups(optim, names)
    return desc


def write_desc(path, model, optim=None) -> Optional[Dict[str, Any]]:
    """Writes ``model``'s DESC.json to ``path``; call it on every rank.

    With ``torch.distributed`` initialized this is a collective (every rank must call it):
    every rank's optimizer param groups are gathered, rank 0 writes the file with
    ``optim_params_per_rank`` (one entry per rank), and every rank returns once the file is in
    place, or raises if describing or writing failed on any rank (no rank is left waiting).
    Without a process group the calling process writes it. The file appears whole or not at
    all (temporary file, fsync, rename). Returns the written description on the writing rank,
    ``None`` on the others.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    try:
        desc, failure = describe(model, optim), None
    except Exception as e:  # every rank must learn of it before anyone waits
        desc, failure = None, e
    groups = None if desc is None else desc.pop("optim_params", None)
    if distributed:
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (groups, None if failure is None else repr(failure)))
        _raise_first(failure, [e for _, e in every], "describing the model")
        groups_per_rank = [g for g, _ in every]
    else:
        if failure is not None:
            raise failure
        groups_per_rank = [groups]
    if optim is not None:
        desc["optim_params_per_rank"] = groups_per_rank
    writer = not distributed or dist.get_rank() == 0
    written = None
    if writer:
        try:
            _write_atomically(os.fspath(path), json.dumps(desc, indent=1, sort_keys=True) + "\n")
        except Exception as e:
            written = e
    if distributed:
        status = [None if written is None else repr(written)]
        dist.broadcast_object_list(status, src=0)
        _raise_first(written, status, f"writing {os.fspath(path)} on rank 0")
    elif written is not None:
        raise written
    return desc if writer else None


def _raise_first(mine: Optional[BaseException], reports: List[Optional[str]], what: str) -> None:
    """Raises this rank's own failure, else the first rank's reported one."""
    if mine is not None:
        raise mine
    for rank, e in enumerate(reports):
        if e is not None:
            raise RuntimeError(f"{what} failed on rank {rank}: {e}")


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

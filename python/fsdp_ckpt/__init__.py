"""Inspect, consolidate, reshard and convert PyTorch FSDP and DCP optimizer checkpoints.

The operations run the Rust crate `fsdp` (the same code as the ``fsdp-ckpt`` command this
package puts on PATH): bit for bit what PyTorch writes, streamed with bounded memory, outputs
written whole or not at all. They take paths (``str`` or ``os.PathLike``), release the GIL
while they work, return a summary as a plain dict, and raise :class:`Error` on bad input.

Long operations take ``progress``, a callable ``progress(phase, done, total)`` called from the
working thread with the GIL held: ``phase`` names the step (``"consolidating"``, ``"reading
rank files"``, ...), ``done`` and ``total`` count bytes or files (``total`` is ``None`` for a
step of unknown size). It is called at each step's start and end and at most every 0.1 s in
between; an exception it raises is reported through ``sys.unraisablehook`` and does not stop
the operation.

``describe`` / ``write_desc`` (module :mod:`fsdp_ckpt.describe`) write the ``DESC.json`` that
``consolidate_torch``, ``shard_torch`` and ``convert(..., to="fsdp")`` need, from a live
FSDP-wrapped model; they need PyTorch, the rest of the package does not.
"""

import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _native
from ._errors import Error
from .describe import describe, write_desc

__version__ = _native.__version__

Path = Union[str, "os.PathLike[str]"]
Progress = Optional[Callable[[str, int, Optional[int]], Any]]

__all__ = [
    "Error",
    "inspect",
    "verify",
    "convert",
    "consolidate",
    "reshard",
    "consolidate_torch",
    "consolidate_sharded",
    "shard_torch",
    "dcp_to_torch_save",
    "torch_save_to_dcp",
    "describe",
    "write_desc",
    "__version__",
]


def _paths(paths: Sequence[Path]) -> List[str]:
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError("expected a list of paths, one per rank, not a single path")
    return [os.fspath(p) for p in paths]


def inspect(path: Path) -> Dict[str, Any]:
    """What a checkpoint holds, read from its structure alone (no tensor data is read).

    ``path`` is a ``.pt``/``.pth``/``.safetensors`` file (keys, dtypes, shapes, steps, param
    groups, tensor bytes), the crate's checkpoint directory (its manifest), or a PyTorch DCP
    directory of any form: ``.metadata``, per-rank ``__{rank}.metadata`` files (merged), or
    Hugging Face storage (``DCP_SHARDING_INFO`` headers) (keys, dtypes, global shapes, chunk
    counts, the data files, where the metadata came from and the world size), or a DeepSpeed
    ZeRO or universal checkpoint (stage, dtype, world size, tag, parameters, their states and
    steps, param groups). The dict is what ``fsdp-ckpt inspect --json PATH`` prints.
    """
    return json.loads(_native.inspect(os.fspath(path)))


def verify(path: Path, *, progress: Progress = None) -> Dict[str, Any]:
    """Checks a checkpoint directory completely, or raises :class:`Error` at the first problem.

    For the crate's checkpoint: commit marker, manifest, file lengths, every checksum block.
    For a DCP directory: every referenced byte range lies inside its file, every chunk parses
    with the metadata's dtype and shape, and the chunks of every tensor cover it exactly once.
    Returns what was checked (``format``, byte and tensor counts).
    """
    return json.loads(_native.verify(os.fspath(path), progress))


def convert(
    input: Path,
    output: Path,
    *,
    to: Optional[str] = None,
    model: Optional[Path] = None,
    world_size: Optional[int] = None,
    max_expansion_bytes: Optional[int] = None,
    progress: Progress = None,
    max_shard_size: Union[str, int, None] = None,
    dtype: Optional[str] = None,
    prefix: Optional[str] = None,
    rename: Union[Mapping[str, str], Sequence[Union[str, Tuple[str, str]]], None] = None,
    rename_map: Optional[Path] = None,
    tie: Union[Mapping[str, str], Sequence[Union[str, Tuple[str, str]]], None] = None,
    config: Optional[Path] = None,
) -> Dict[str, Any]:
    """Converts a checkpoint; ``fsdp-ckpt convert``.

    Without ``to``: torch.save <-> safetensors, formats by extension; the dict comes back equal
    after a round trip. ``to="dcp"``: a DCP directory, from a ``.pt``/``.safetensors`` file
    (what ``torch_save_to_dcp`` writes), from the crate's checkpoint directory, from a
    Hugging Face model directory (keys under ``prefix``, default ``"model."``), or from a
    DeepSpeed ZeRO or universal checkpoint (the fp32 weights and Adam state as
    ``get_state_dict`` names them: an FSDP2 model loads it with ``dcp.load`` and
    ``set_state_dict`` at any world size and trains on).
    ``to="fsdp"``: the crate's checkpoint from a DCP directory, for ``world_size`` ranks of the
    model that ``model`` (a DESC.json) describes. ``max_expansion_bytes`` caps what copies of
    non-contiguous tensors of a torch.save input may allocate beyond its storage bytes.

    ``to="hf"``: the model weights of a DCP directory, the crate's checkpoint or a file as the
    Hugging Face model directory ``save_pretrained`` writes. ``max_shard_size`` (``"50GB"``
    by default; ``"60KB"``, ``"512MiB"`` or bytes) splits the files as huggingface_hub does;
    ``dtype`` (``"bf16"``, ``"f16"``, ``"f32"``) casts floating-point tensors; ``prefix`` is
    the subtree holding the model (``"model."`` by default, ``""`` for every tensor outside
    ``optim.``); ``rename`` maps keys with regular expressions (a dict, or ``"FROM=TO"``
    strings / ``(FROM, TO)`` pairs, applied in order; ``rename_map`` a JSON file of them);
    ``tie`` leaves out ``NAME`` once checked equal to ``SOURCE``; ``config`` is copied in as
    ``config.json`` and its ``tie_word_embeddings`` ties the head to the embedding as transformers
    ties that architecture (an architecture outside the table needs ``tie``).
    """
    return json.loads(
        _native.convert(
            os.fspath(input),
            os.fspath(output),
            to,
            None if model is None else os.fspath(model),
            world_size,
            max_expansion_bytes,
            progress,
            None if max_shard_size is None else str(max_shard_size),
            dtype,
            prefix,
            _rules(rename, "rename"),
            None if rename_map is None else os.fspath(rename_map),
            _rules(tie, "tie"),
            None if config is None else os.fspath(config),
        )
    )


def _rules(rules, what: str) -> List[str]:
    """``FROM=TO`` strings from a mapping, pairs, or strings (a ``FROM`` containing ``=``
    belongs in a ``rename_map`` file)."""
    if rules is None:
        return []
    if isinstance(rules, str):
        raise TypeError(f"{what}: give a list of FROM=TO strings or a mapping, not one string")
    items = rules.items() if isinstance(rules, Mapping) else rules
    out = []
    for r in items:
        if isinstance(r, str):
            out.append(r)
        else:
            a, b = r
            if "=" in a:
                raise ValueError(f"{what}: {a!r} contains '='; put such a rule in rename_map")
            out.append(f"{a}={b}")
    return out


def consolidate(
    input: Path, output: Path, *, optim: bool = False, progress: Progress = None
) -> Dict[str, Any]:
    """Writes one full state file from a sharded checkpoint directory; ``fsdp-ckpt consolidate``.

    ``input`` is a PyTorch DCP directory (the output is what
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes: same nesting, key
    order and key types, bit-identical tensors; per-rank ``__{rank}.metadata`` files are merged,
    giving the saving run's full state dict where PyTorch's own function returns other ranks'
    rows uninitialised; Hugging Face storage gives what ``HuggingFaceStorageReader`` loads),
    the crate's checkpoint directory (the full, name-keyed optimizer state dict), or a
    DeepSpeed ZeRO (stage 1, 2 or 3) or universal checkpoint, read without DeepSpeed (the fp32
    weights ``zero_to_fp32``'s ``get_fp32_state_dict_from_zero_checkpoint`` returns; with
    ``optim=True``, ``{"model": ..., "optim": {"state": ..., "param_groups": ...}}`` with
    Adam's state, named as ``get_state_dict(full_state_dict=True)`` names it; ``optim`` is
    refused for other inputs). ``output`` ends in ``.pt``/``.pth`` or ``.safetensors``.
    Streamed: memory stays near the largest tensor, not the checkpoint's size.
    """
    return json.loads(
        _native.consolidate(os.fspath(input), os.fspath(output), progress, optim)
    )


def reshard(
    input: Path,
    output: Path,
    world_size: int,
    *,
    policy: Optional[Path] = None,
    progress: Progress = None,
) -> Dict[str, Any]:
    """Rewrites the crate's checkpoint directory for ``world_size`` ranks; ``fsdp-ckpt reshard``.

    ``policy`` is a JSON wrapping policy, or a DESC.json whose ``policy`` is used (default:
    the saved one). ``output`` must be missing, empty or an earlier checkpoint (replaced
    atomically); the input is never modified.
    """
    return json.loads(
        _native.reshard(
            os.fspath(input),
            os.fspath(output),
            world_size,
            None if policy is None else os.fspath(policy),
            progress,
        )
    )


def consolidate_torch(
    model: Path,
    ranks: Sequence[Path],
    output: Path,
    *,
    named_optimizer: bool = False,
    progress: Progress = None,
) -> Dict[str, Any]:
    """Consolidates every rank's ``optim.state_dict()`` of an FSDP1 run; ``fsdp-ckpt consolidate-torch``.

    ``model`` is the DESC.json of the wrapped model (see :func:`write_desc`), ``ranks`` one file
    per rank in rank order. The output is the dict ``FSDP.full_optim_state_dict`` returns, bit
    for bit. ``named_optimizer``: the state is keyed by parameter names, not ids.
    """
    return json.loads(
        _native.consolidate_torch(
            os.fspath(model), _paths(ranks), os.fspath(output), named_optimizer, progress
        )
    )


def consolidate_sharded(
    ranks: Sequence[Path], output: Path, *, progress: Progress = None
) -> Dict[str, Any]:
    """Consolidates per-rank SHARDED optimizer state dicts; ``fsdp-ckpt consolidate-sharded``.

    Each rank file holds FSDP1 ``ShardedTensor`` states (SHARDED_STATE_DICT) or FSDP2
    ``DTensor`` states of ``optim.state_dict()``; the output holds the full tensors.
    """
    return json.loads(_native.consolidate_sharded(_paths(ranks), os.fspath(output), progress))


def shard_torch(
    model: Path,
    full: Path,
    world_size: int,
    output: Path,
    *,
    named_optimizer: bool = False,
    ext: str = "pt",
    tuples_as_lists: bool = False,
    progress: Progress = None,
) -> Dict[str, Any]:
    """Shards a full optimizer state dict for ``world_size`` ranks; ``fsdp-ckpt shard-torch``.

    Writes ``output/rank{r}.{ext}``: what ``FSDP.shard_full_optim_state_dict`` gives each rank,
    installed as one directory (missing, empty, or an earlier shard-torch output). For FSDP2,
    ``tuples_as_lists=True`` writes the param groups' tuples (``betas``) as lists, as
    ``set_optimizer_state_dict(full_state_dict=True)`` leaves them; by default they stay as
    the full dict has them, as ranks hold them after ``dcp.load`` + ``set_state_dict``.
    """
    return json.loads(
        _native.shard_torch(
            os.fspath(model),
            os.fspath(full),
            world_size,
            os.fspath(output),
            named_optimizer,
            ext,
            progress,
            tuples_as_lists,
        )
    )


def dcp_to_torch_save(
    dcp_checkpoint_dir: Path, torch_save_path: Path, *, progress: Progress = None
) -> Dict[str, Any]:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, streamed: :func:`consolidate`."""
    return consolidate(dcp_checkpoint_dir, torch_save_path, progress=progress)


def torch_save_to_dcp(
    torch_save_path: Path, dcp_checkpoint_dir: Path, *, progress: Progress = None
) -> Dict[str, Any]:
    """``torch.distributed.checkpoint.format_utils.torch_save_to_dcp``: ``convert(..., to="dcp")``."""
    return convert(torch_save_path, dcp_checkpoint_dir, to="dcp", progress=progress)

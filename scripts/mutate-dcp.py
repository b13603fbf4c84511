"""Mutation campaign: `fsdp-ckpt` and PyTorch must agree on every mutated DCP checkpoint.

    .venv/bin/python scripts/mutate-dcp.py --seed 1 --count 20000 --jobs 2 \\
        --report /tmp/mutate.json --keep /tmp/mutants-kept

Fixtures are the DCP directories `tests/golden/dcp/*/ckpt`, the zstd-compressed
`tests/golden/dcp_forms/zstd_ws3/ckpt` and `tests/golden/dcp_forms/local_plans_ws2/ckpt` (every
rank's `SavePlan` kept in `.metadata`, as Megatron-Core's `torch_dist` keeps them) (`--fixtures GLOB,GLOB,...`, relative to the repository
root), each a `.metadata` pickle and `__R_0.distcp` data files written by
`torch.distributed.checkpoint.save` (the zstd one with `FileSystemWriter(_extensions=
[ZStandard()])`: every item one zstd frame, `transform_descriptors == ["stream.zstd/1"]`). Mutant I of a run is drawn from `random.Random("SEED:I")`
alone, so with the same fixtures it is the same whatever `--count` and `--jobs` are. About
65 % of mutants change `.metadata`:

* raw bytes: a bit flip, 1-4 overwritten bytes, a truncation, 1-4 inserted bytes;
* an integer argument (BININT1, BININT2, BININT, LONG1, ...; sizes, offsets, lengths) set to
  0, 1, -1, one off, a large value or another integer of the same pickle;
* a string argument (SHORT_BINUNICODE, BINUNICODE, ...; keys, paths, class names) set to
  another string of the pickle or a slightly edited one;
* a structural edit of the unpickled `Metadata`, pickled again: a `planner_data` path set to
  another key's path, cut, extended, split at a dot, with a list index renumbered or an int
  item turned into a string, two paths swapped; a key dropped from `planner_data`,
  `storage_data` or `state_dict_metadata`; a chunk dropped; a tensor's dtype changed.

Integer and string edits re-encode the argument and fix the FRAME length, so the pickle stays
well-formed. The other 35 % change one `.distcp` file: a bit flip, overwritten bytes or a
truncation, in the zip headers of an item's torch.save archive, in its tensor bytes or in its
`data.pkl`; in a compressed item, in its frame's head (magic number and frame header) or in
its blocks (which mostly gives a zstd error on both sides).

Each mutant goes through `fsdp-ckpt --quiet verify DIR`, `fsdp-ckpt --quiet consolidate DIR
OUT.pt` (each accepted: exit 0; refused: exit 1 with `error: ...` on stderr; anything else,
a panic, a signal or the 60 s timeout, is a crash) and PyTorch's
`format_utils.dcp_to_torch_save(DIR, TORCH.pt)` followed by `torch.load(TORCH.pt,
weights_only=False)`. PyTorch runs in long-lived worker processes (`--jobs` of them, each in
a temporary working directory, restarted when one dies or overruns 60 s); PyTorch "succeeds"
when neither call raises, whatever it logged. When it succeeds, the worker checks its result
against the mutant's metadata: the keys of the output flattened as `flatten_state_dict` does
(path items joined with '.') must be the keys of `state_dict_metadata`, each tensor must have
the declared dtype and shape, its chunks must lie inside it and cover it exactly once, and
each chunk's stored tensor (read through its transforms as PyTorch reads it) must have the
declared dtype, shape and the bytes found at its place in the output; each compressed item
PyTorch read must be whole zstd frames (skippable ones allowed) that decompress to exactly one
archive (PyTorch's `zstandard` reader passes over a frame the range cuts short, and
`torch.load` ignores bytes after an archive, or another archive's end records appended:
a `length` grown into the next item's frame is read without a word); and when only a data
file was mutated, the output must equal PyTorch's
output for the unmutated fixture (PyTorch does not check the zip CRC-32, so it returns a
flipped tensor byte as data). The first violation is PyTorch's loss. Outcomes, one per mutant:

* CRASH: verify or consolidate neither accepted nor refused;
* VERIFY_MISMATCH: verify accepted and consolidate refused, or the reverse;
* equal: both consolidated and the two outputs, loaded with torch.load, are deep-equal
  (container types, key order, non-tensor values by type and value (floats by bits),
  tensors by dtype, shape and bytes);
* both_refuse: the tool refused and PyTorch raised;
* torch_lossy: the tool refused and PyTorch succeeded with a loss (the reason is recorded),
  or the tool refused an archive whose CRC-32 does not match and PyTorch, which never checks
  it, read the corrupt archive. A loss is also a record of an item's archive flagged as
  compressed (torch.save stores every record raw) that PyTorch reads as other bytes than
  the stored ones: miniz inflates raw bytes and sets no error when that fails;
* DISAGREE: anything else (the tool accepts what PyTorch refuses, refuses what PyTorch loads
  without loss, or both accept with different results).

The binary is copied first, so rebuilding it during a run does not mix versions. Children
run with a 4 GiB data and a 256 MiB file-size limit (a declared size can be huge):
the tool killed by one is a CRASH; PyTorch hitting one raises, which counts as refusing.

Prints progress every 500 mutants and counts per outcome and per fixture at the end.
`--report FILE` writes JSON with every mutant that is not equal or both_refuse (index,
fixture, mutation, the tool's stderr, PyTorch's first error line or loss, the outputs' first
difference); `--keep DIR` copies those mutants' directories to DIR/INDEX-OUTCOME. Exits 1
when any DISAGREE, VERIFY_MISMATCH or CRASH occurred (2 when an unmutated fixture is not
equal: then the campaign does not run).
"""

import argparse
import glob
import io
import json
import os
import pickle
import pickletools
import queue
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
import zstandard
from torch.distributed.checkpoint import _extension, _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

REPO = Path(__file__).resolve().parent.parent
OUTCOMES = ["equal", "both_refuse", "torch_lossy", "DISAGREE", "VERIFY_MISMATCH", "CRASH"]
REPORTED = {"torch_lossy", "DISAGREE", "VERIFY_MISMATCH", "CRASH"}
FAILING = {"DISAGREE", "VERIFY_MISMATCH", "CRASH"}
TIMEOUT = 60
WORKER_START_TIMEOUT = 180
DATA_LIMIT = 4 << 30
FILE_SIZE_LIMIT = 256 << 20
PROGRESS_EVERY = 500
DEFAULT_FIXTURES = (
    "tests/golden/dcp/*/ckpt,tests/golden/dcp_forms/zstd_ws3/ckpt,"
    "tests/golden/dcp_forms/local_plans_ws2/ckpt"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8,
          torch.bool]


# ---------------------------------------------------------------------------------------------
# Fixtures: each one read once, with what the mutations pick from.


class Fixture:
    """A pristine DCP directory: its files, the pickle's opcodes and the data files' regions."""

    def __init__(self, ckpt: Path):
        self.name = ckpt.parent.name
        self.path = ckpt
        self.files = {p.name: p.read_bytes() for p in sorted(ckpt.iterdir()) if p.is_file()}
        data = self.files[".metadata"]
        ops = list(pickletools.genops(data))
        ends = [pos for _, _, pos in ops[1:]] + [len(data)]
        self.protocol = ops[0][1] if ops[0][0].name == "PROTO" else 2
        self.frame = next(((pos, arg) for op, arg, pos in ops if op.name == "FRAME"), None)
        self.int_args = [(pos, end, op.name, arg) for (op, arg, pos), end in zip(ops, ends)
                         if isinstance(arg, int) and op.name not in ("PROTO", "FRAME")
                         and "GET" not in op.name and "PUT" not in op.name]
        self.str_args = [(pos, end, op.name, arg) for (op, arg, pos), end in zip(ops, ends)
                         if isinstance(arg, str) and "UNICODE" in op.name]
        self.ints = sorted({arg for *_, arg in self.int_args})
        self.strings = sorted({arg for *_, arg in self.str_args})
        self.regions, self.items = data_file_regions(self.files, pickle.loads(data))


DATA_KINDS = {"zip header": 45, "tensor bytes": 35, "item pickle": 20, "zstd frame head": 40,
              "zstd blocks": 60}


def data_file_regions(files, metadata):
    """Per data file: byte ranges by kind (zip header, tensor bytes, item pickle; for a
    compressed item, its frame's head and its blocks), and items."""
    regions, items = {}, {}
    for index, info in metadata.storage_data.items():
        start, end = info.offset, info.offset + info.length
        items.setdefault(info.relative_path, []).append((start, end, index.fqn))
        kinds = regions.setdefault(info.relative_path, {kind: [] for kind in DATA_KINDS})
        archive = files[info.relative_path][start:end]
        if info.transform_descriptors:
            # The magic number and frame header (6 bytes at least), then the blocks.
            head = zstd_frame_head(archive)
            kinds["zstd frame head"].append((start, start + head))
            kinds["zstd blocks"].append((start + head, end))
            continue
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            for entry in z.infolist():
                header = entry.header_offset
                name_len, extra_len = struct.unpack("<HH", archive[header + 26:header + 30])
                data_start = header + 30 + name_len + extra_len
                kinds["zip header"].append((start + header, start + data_start))
                payload = (start + data_start, start + data_start + entry.compress_size)
                if "/data/" in entry.filename:
                    kinds["tensor bytes"].append(payload)
                elif entry.filename.endswith("data.pkl"):
                    kinds["item pickle"].append(payload)
            kinds["zip header"].append((start + z.start_dir, end))
    return regions, items


def zstd_frame_head(frame: bytes) -> int:
    """Bytes of a zstd frame before its first block: the magic number and the frame header
    (RFC 8878, 3.1.1.1: descriptor, window descriptor, dictionary id, content size)."""
    descriptor = frame[4]
    single_segment = descriptor >> 5 & 1
    fcs = [single_segment, 2, 4, 8][descriptor >> 6]
    dict_id = [0, 1, 2, 4][descriptor & 3]
    return 4 + 1 + (1 - single_segment) + dict_id + fcs


def load_fixtures(patterns: str):
    ckpts = sorted({Path(p) for pattern in patterns.split(",")
                    for p in glob.glob(os.path.join(REPO, pattern))})
    fixtures = [Fixture(c) for c in ckpts if (c / ".metadata").is_file()]
    if not fixtures:
        raise SystemExit(f"no DCP fixture matches {patterns}")
    return fixtures


# ---------------------------------------------------------------------------------------------
# Mutations: each returns (description, {file name: new bytes}).


def mutate(fixture: Fixture, rng: random.Random):
    if rng.random() < 0.65:
        kind = rng.choices(["raw", "int", "string", "structure"], weights=[35, 30, 20, 15])[0]
        edit = {"raw": mutate_metadata_bytes, "int": mutate_metadata_int,
                "string": mutate_metadata_string, "structure": mutate_metadata_structure}[kind]
        return edit(fixture, rng)
    return mutate_data_file(fixture, rng)


def mutate_metadata_bytes(fixture, rng):
    data = bytearray(fixture.files[".metadata"])
    op = rng.choice(["flip", "overwrite", "truncate", "insert"])
    pos = rng.randrange(len(data))
    what = damage(data, op, pos, rng)
    return f".metadata raw: {what}", {".metadata": bytes(data)}


def damage(data, op, pos, rng):
    """Applies `op` (flip, overwrite, truncate, insert) to `data` at `pos`; says what it did."""
    if op == "flip":
        bit = rng.randrange(8)
        data[pos] ^= 1 << bit
        return f"flip bit {bit} at byte {pos}"
    if op == "overwrite":
        new = rng.randbytes(rng.randint(1, 4))
        data[pos:pos + len(new)] = new
        return f"overwrite byte {pos} with {new.hex()}"
    if op == "truncate":
        del data[pos:]
        return f"truncate to {pos} bytes"
    new = rng.randbytes(rng.randint(1, 4))
    data[pos:pos] = new
    return f"insert {new.hex()} at byte {pos}"


def mutate_metadata_int(fixture, rng):
    pos, end, name, value = rng.choice(fixture.int_args)
    candidates = [0, 1, -1, value + 1, value - 1, 2**31 - 1, 2**32, 2**62, rng.choice(fixture.ints)]
    new = rng.choice([c for c in candidates if c != value])
    data = replace_op(fixture, pos, end, encode_int(new))
    return f".metadata int: {name} at byte {pos}: {value} -> {new}", {".metadata": data}


def mutate_metadata_string(fixture, rng):
    pos, end, name, value = rng.choice(fixture.str_args)
    edit = rng.choice(["other", "other", "drop last", "append", "change char", "empty", "parent"])
    if edit == "other":
        new = rng.choice([s for s in fixture.strings if s != value])
    elif edit == "drop last":
        new = value[:-1]
    elif edit == "append":
        new = value + rng.choice(["x", ".", "0", ".weight"])
    elif edit == "change char":
        i = rng.randrange(max(len(value), 1))
        new = value[:i] + rng.choice("ax0._/") + value[i + 1:]
    elif edit == "parent":
        new = "../" + value
    else:
        new = ""
    data = replace_op(fixture, pos, end, encode_str(new))
    return f".metadata string: {name} at byte {pos}: {value!r} -> {new!r}", {".metadata": data}


def encode_int(value: int) -> bytes:
    """The opcode pickle itself would write for `value`."""
    if 0 <= value < 1 << 8:
        return b"K" + bytes([value])
    if 0 <= value < 1 << 16:
        return b"M" + struct.pack("<H", value)
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def encode_str(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw
    return b"X" + struct.pack("<I", len(raw)) + raw


def replace_op(fixture, pos, end, new: bytes) -> bytes:
    """`.metadata` with the opcode at [pos, end) replaced by `new`, its FRAME length fixed."""
    data = bytearray(fixture.files[".metadata"])
    data[pos:end] = new
    if fixture.frame is not None:
        frame_pos, frame_len = fixture.frame
        if frame_pos + 9 <= pos < frame_pos + 9 + frame_len:
            new_len = frame_len + len(new) - (end - pos)
            data[frame_pos + 1:frame_pos + 9] = struct.pack("<Q", new_len)
    return bytes(data)


def mutate_metadata_structure(fixture, rng):
    """An edit of the unpickled Metadata; the edits not applicable to it are skipped."""
    md = pickle.loads(fixture.files[".metadata"])
    edits = list(STRUCTURE_EDITS)
    rng.shuffle(edits)
    for edit in edits:
        what = edit(md, rng)
        if what is not None:
            data = pickle.dumps(md, protocol=fixture.protocol)
            return f".metadata structure: {what}", {".metadata": data}
    raise AssertionError("no structural edit applies")


def pick_path(md, rng, accept=lambda path: True):
    keys = [k for k, path in (md.planner_data or {}).items() if accept(path)]
    return rng.choice(keys) if keys else None


def path_to_other_key(md, rng):
    key = pick_path(md, rng)
    other = pick_path(md, rng, lambda path: path != md.planner_data.get(key))
    if key is None or other is None:
        return None
    md.planner_data[key] = md.planner_data[other]
    return f"planner_data[{key!r}] = path of {other!r} {md.planner_data[other]}"


def path_cut(md, rng):
    key = pick_path(md, rng, lambda path: len(path) > 1)
    if key is None:
        return None
    md.planner_data[key] = md.planner_data[key][:-1]
    return f"planner_data[{key!r}] cut to {md.planner_data[key]}"


def path_extend(md, rng):
    key = pick_path(md, rng)
    if key is None:
        return None
    md.planner_data[key] = md.planner_data[key] + (rng.choice(["x", 0]),)
    return f"planner_data[{key!r}] extended to {md.planner_data[key]}"


def path_split_dot(md, rng):
    key = pick_path(md, rng, lambda path: any(isinstance(p, str) and "." in p for p in path))
    if key is None:
        return None
    md.planner_data[key] = tuple(q for p in md.planner_data[key]
                                 for q in (p.split(".") if isinstance(p, str) else [p]))
    return f"planner_data[{key!r}] split at dots to {md.planner_data[key]}"


def path_renumber(md, rng):
    key = pick_path(md, rng, lambda path: any(type(p) is int for p in path))
    if key is None:
        return None
    path = list(md.planner_data[key])
    i = rng.choice([i for i, p in enumerate(path) if type(p) is int])
    path[i] = rng.choice([path[i] + 1, path[i] + 2, -1])
    md.planner_data[key] = tuple(path)
    return f"planner_data[{key!r}] list index renumbered to {md.planner_data[key]}"


def path_int_to_str(md, rng):
    key = pick_path(md, rng, lambda path: any(type(p) is int for p in path))
    if key is None:
        return None
    md.planner_data[key] = tuple(str(p) for p in md.planner_data[key])
    return f"planner_data[{key!r}] int items as strings: {md.planner_data[key]}"


def path_swap(md, rng):
    a, b = pick_path(md, rng), pick_path(md, rng)
    if a is None or a == b:
        return None
    md.planner_data[a], md.planner_data[b] = md.planner_data[b], md.planner_data[a]
    return f"planner_data paths of {a!r} and {b!r} swapped"


def drop_planner_key(md, rng):
    key = pick_path(md, rng)
    if key is None:
        return None
    del md.planner_data[key]
    return f"planner_data[{key!r}] dropped"


def drop_storage_entry(md, rng):
    index = rng.choice(list(md.storage_data))
    del md.storage_data[index]
    return f"storage_data[{index.fqn!r} at {list(index.offset or [])}] dropped"


def drop_state_dict_key(md, rng):
    key = rng.choice(list(md.state_dict_metadata))
    del md.state_dict_metadata[key]
    return f"state_dict_metadata[{key!r}] dropped"


def drop_chunk(md, rng):
    keys = [k for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and v.chunks]
    key = rng.choice(keys)
    chunks = md.state_dict_metadata[key].chunks
    i = rng.randrange(len(chunks))
    dropped = chunks.pop(i)
    return f"chunk {i} of {key!r} dropped ({list(dropped.offsets)}+{list(dropped.sizes)})"


def change_dtype(md, rng):
    keys = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    key = rng.choice(keys)
    props = md.state_dict_metadata[key].properties
    old = props.dtype
    props.dtype = rng.choice([d for d in DTYPES if d != old])
    return f"dtype of {key!r}: {old} -> {props.dtype}"


STRUCTURE_EDITS = [path_to_other_key, path_cut, path_extend, path_split_dot, path_renumber,
                   path_int_to_str, path_swap, drop_planner_key, drop_storage_entry,
                   drop_state_dict_key, drop_chunk, change_dtype]


def mutate_data_file(fixture, rng):
    name = rng.choice(sorted(fixture.regions))
    kinds = [k for k in DATA_KINDS if any(b > a for a, b in fixture.regions[name][k])]
    kind = rng.choices(kinds, weights=[DATA_KINDS[k] for k in kinds])[0]
    ranges = [r for r in fixture.regions[name][kind] if r[1] > r[0]]
    start, end = rng.choices(ranges, weights=[b - a for a, b in ranges])[0]
    pos = rng.randrange(start, end)
    item = next(fqn for a, b, fqn in fixture.items[name] if a <= pos < b)
    data = bytearray(fixture.files[name])
    op = rng.choices(["flip", "overwrite", "truncate"], weights=[45, 35, 20])[0]
    what = damage(data, op, pos, rng)
    return f"{name} {kind}: {what} (item {item!r})", {name: bytes(data)}


# ---------------------------------------------------------------------------------------------
# The tool's side.


def run_tool(binary, *args):
    """(status, stderr): status is 'ok', 'refused' or 'crash: WHY'."""
    try:
        proc = subprocess.run([str(binary), "--quiet", *map(str, args)], capture_output=True,
                              timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"crash: timeout after {TIMEOUT} s", ""
    stderr = proc.stderr.decode("utf-8", "replace").strip()[:2000]
    if proc.returncode == 0:
        return "ok", stderr
    if proc.returncode == 1 and stderr.startswith("error:"):
        return "refused", stderr
    if proc.returncode < 0:
        return f"crash: killed by {signal.Signals(-proc.returncode).name}", stderr
    if proc.returncode == 101:
        return "crash: panic (exit 101)", stderr
    return f"crash: exit {proc.returncode}", stderr


# ---------------------------------------------------------------------------------------------
# PyTorch's side: a worker process (`--torch-worker`) answering one JSON line per mutant.


class TorchWorker:
    """One long-lived worker process, started on demand and restarted when it dies or overruns."""

    def __init__(self, root: Path):
        self.root = root
        self.proc = None
        self.buffer = b""

    def start(self):
        cwd = tempfile.mkdtemp(prefix="torch-worker-", dir=self.root)
        command = [sys.executable, str(Path(__file__).resolve()), "--torch-worker"]
        self.proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.buffer = b""
        ready = self.read_line(WORKER_START_TIMEOUT)
        if not isinstance(ready, dict) or not ready.get("ready"):
            raise RuntimeError(f"the PyTorch worker did not start: {ready}")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def read_line(self, timeout):
        """The next JSON line, or an error text when the worker died or overran."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.stop()
                return f"PyTorch timed out after {timeout} s"
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                status = self.proc.wait()
                self.stop()
                how = f"killed by {signal.Signals(-status).name}" if status < 0 \
                    else f"exit {status}"
                return f"PyTorch worker died ({how})"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, request):
        if self.proc is None:
            self.start()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.stop()
            return {"ok": False, "error": "PyTorch worker died"}
        answer = self.read_line(TIMEOUT)
        return answer if isinstance(answer, dict) else {"ok": False, "error": answer}


def torch_worker():
    """The worker's loop: requests on stdin, answers on the original stdout, all else muted."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    torch.set_num_threads(1)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        print(json.dumps(torch_side(**json.loads(line))), file=answers, flush=True)


def torch_side(ckpt, torch_out, tool_out, reference):
    """PyTorch's conversion of `ckpt`, its loss and its first difference from the tool's output.

    `reference`, given when only data files were mutated, is PyTorch's output for the unmutated
    fixture: the metadata being the same, any other output is corrupt.
    """
    _version._derived_version = None  # module state a failed load may leave set
    try:
        dcp_to_torch_save(ckpt, torch_out)
        got = torch.load(torch_out, weights_only=False)
    except BaseException as e:  # a hostile pickle may raise anything, SystemExit included
        return {"ok": False, "error": first_line(e)}
    result = {"ok": True, "lossy": torch_loss(Path(ckpt), got)}
    if result["lossy"] is None and reference is not None:
        diff = first_difference(torch.load(reference, weights_only=False), got, "")
        if diff:
            result["lossy"] = f"output differs from the unmutated checkpoint's: {diff}"
    if tool_out is not None:
        try:
            tool = torch.load(tool_out, weights_only=False)
        except Exception as e:
            result["diff"] = f"the tool's output does not load: {first_line(e)}"
        else:
            result["diff"] = first_difference(got, tool, "")
    return result


def first_line(e: BaseException) -> str:
    """The exception's first line; for a CheckpointException, its first wrapped exception's."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = f"{type(e).__name__}: {e}" if str(e).strip() else type(e).__name__
    return text.splitlines()[0][:500]


def torch_loss(ckpt: Path, got):
    """What PyTorch's output lacks or holds wrongly against the metadata it read, or None."""
    try:
        with open(ckpt / ".metadata", "rb") as f:
            md = pickle.load(f)
        loss = compressed_record_loss(ckpt, md) or zstd_item_loss(ckpt, md)
        if loss:
            return loss
        try:
            flat, _ = flatten_state_dict(got)
        except ValueError as e:
            return f"output does not flatten: {e}"
        declared = set(md.state_dict_metadata)
        if set(flat) != declared:
            missing, extra = sorted(declared - set(flat)), sorted(set(flat) - declared)
            return f"flattened keys differ: missing {missing[:3]}, extra {extra[:3]}"
        for key, smd in md.state_dict_metadata.items():
            if isinstance(smd, TensorStorageMetadata):
                loss = tensor_loss(ckpt, md, key, smd, flat[key])
                if loss:
                    return loss
        return None
    except Exception as e:
        return f"unchecked, the check raised {first_line(e)}"


def compressed_record_loss(ckpt, md):
    """A record of an item's archive that claims to be compressed (torch.save stores every
    record raw) and that PyTorch reads as other bytes than the stored ones, or None. miniz
    inflates the raw bytes into a buffer of the record's size and sets no error when the
    inflation fails, so PyTorch returns what it made of them without a word."""
    for info in {(i.relative_path, i.offset, i.length, tuple(i.transform_descriptors or ()))
                 for i in md.storage_data.values()}:
        path, offset, length, transforms = info
        with open(ckpt / path, "rb") as f:
            f.seek(offset)
            blob = f.read(min(length, 1 << 30))
        try:
            blob = untransformed(blob, transforms)
        except Exception:
            continue
        try:
            archive = zipfile.ZipFile(io.BytesIO(blob))
        except (zipfile.BadZipFile, UnicodeDecodeError):
            continue
        reader = None
        for z in archive.infolist():
            if z.compress_type == 0 or "/" not in z.filename:
                continue
            local = z.header_offset
            name_len, extra_len = struct.unpack("<HH", blob[local + 26:local + 30])
            start = local + 30 + name_len + extra_len
            stored = blob[start:start + z.compress_size]
            reader = reader or torch._C.PyTorchFileReader(io.BytesIO(blob))
            record = z.filename.split("/", 1)[1]
            if not reader.has_record(record):
                continue
            try:
                got = bytes(reader.get_record(record))
            except Exception:
                continue
            if got != stored:
                return (f"{path}@{offset}: record {record!r} is flagged compressed "
                        f"(method {z.compress_type}); PyTorch reads it as {got[:8]!r}, "
                        f"stored {stored[:8]!r}")
    return None


def untransformed(blob, transforms):
    """An item's bytes as PyTorch's loader reads them: through its `transform_descriptors`
    (`ZStandard.transform_from`, `zstandard`'s stream reader, read to its end)."""
    if not transforms:
        return blob
    stream = io.BytesIO(blob)
    for extension in _extension.ExtensionRegistry().from_descriptor_list(transforms):
        stream = extension.transform_from(stream)
    return stream.read(-1)


def used_items(md):
    """The storage records PyTorch's loader reads: each non-empty chunk's and each value's."""
    for key, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            for chunk in smd.chunks:
                if 0 not in list(chunk.sizes):
                    yield key, md.storage_data.get(MetadataIndex(key, chunk.offsets))
        else:
            yield key, md.storage_data.get(MetadataIndex(key))


def zstd_item_loss(ckpt, md):
    """A compressed item PyTorch read although its range is not whole zstd frames that
    decompress to exactly one archive, or None. `zstandard`'s stream reader passes over a frame
    the range cuts short, and `torch.load` reads the last end record it finds, ignoring bytes
    after an archive (another frame's archive, trailing bytes)."""
    for key, info in used_items(md):
        if info is None or list(info.transform_descriptors or ()) != ["stream.zstd/1"]:
            continue
        where = f"{key} ({info.relative_path}@{info.offset}+{info.length})"
        size = (ckpt / info.relative_path).stat().st_size
        if info.offset + info.length > size:
            return (f"{where}: the range lies past the end of the {size}-byte file; PyTorch "
                    f"reads to the file's end, through the frames of the items after it")
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        out, why = zstd_frames(blob)
        if why is None:
            why = archive_gap(out)
        if why is not None:
            return f"{where}: {why}; PyTorch reads it without a word"
    return None


def zstd_frames(blob):
    """The output of the zstd frames `blob` holds, and why it is not only whole frames."""
    out, pos = bytearray(), 0
    while pos < len(blob):
        magic = int.from_bytes(blob[pos:pos + 4], "little")
        if len(blob) - pos >= 4 and magic & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame
            size = int.from_bytes(blob[pos + 4:pos + 8], "little")
            pos += 8 + size
            if pos > len(blob):
                return out, "a skippable frame is cut short"
            continue
        obj = zstandard.ZstdDecompressor().decompressobj()
        try:
            out += obj.decompress(blob[pos:])
        except zstandard.ZstdError as e:
            return out, f"bytes at {pos} are no zstd frame ({e})"
        if not obj.eof:
            return out, f"the zstd frame at {pos} is cut short by the range's end"
        pos = len(blob) - len(obj.unused_data)
    return bytes(out), None


def archive_gap(data):
    """Why the zip archive `data` holds does not take all of it (bytes after its end record,
    or end records of another archive appended), or None; None too for what is no zip."""
    if not data.startswith(b"PK\x03\x04"):
        return None
    eocd = data.rfind(b"PK\x05\x06", max(0, len(data) - 22 - 0xFFFF))
    if eocd < 0:
        return None
    comment = struct.unpack("<H", data[eocd + 20:eocd + 22])[0]
    if eocd + 22 + comment != len(data):
        return f"it decompresses to {len(data) - eocd - 22 - comment} bytes past its archive's end"
    cd_size, cd_offset = struct.unpack("<II", data[eocd + 12:eocd + 20])
    records = eocd
    if eocd >= 76 and data[eocd - 20:eocd - 16] == b"PK\x06\x07":
        rec = struct.unpack("<Q", data[eocd - 12:eocd - 4])[0]
        if rec <= len(data) - 56 and data[rec:rec + 4] == b"PK\x06\x06":
            if rec + 12 + struct.unpack("<Q", data[rec + 4:rec + 12])[0] != eocd - 20:
                return "it decompresses to more than one archive (zip64 records apart)"
            cd_size, cd_offset = struct.unpack("<QQ", data[rec + 40:rec + 56])
            records = rec
    if cd_offset + cd_size != records:
        return "it decompresses to more than one archive (central directory apart from its end)"
    return None


def tensor_loss(ckpt, md, key, smd, tensor):
    if not isinstance(tensor, torch.Tensor):
        return f"{key}: a {type(tensor).__name__} where a tensor is declared"
    if tensor.dtype != smd.properties.dtype or tuple(tensor.shape) != tuple(smd.size):
        return (f"{key}: {tensor.dtype} {list(tensor.shape)}, "
                f"declared {smd.properties.dtype} {list(smd.size)}")
    cover = torch.zeros(tensor.shape, dtype=torch.uint8)
    for i, chunk in enumerate(smd.chunks):
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        if len(offsets) != tensor.dim() or len(sizes) != tensor.dim() or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, tensor.shape)):
            return f"{key}: chunk {i} {offsets}+{sizes} is not inside {list(tensor.shape)}"
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        cover[region] += 1
        if 0 in sizes:
            continue  # PyTorch reads no empty chunk
        stored = read_chunk(ckpt, md.storage_data[MetadataIndex(key, chunk.offsets, i)])
        if stored.dtype != tensor.dtype or list(stored.shape) != sizes:
            return (f"{key}: chunk {i} stores {stored.dtype} {list(stored.shape)}, "
                    f"declared {tensor.dtype} {sizes}")
        if not torch.equal(raw_bytes(stored), raw_bytes(tensor[region])):
            return f"{key}: chunk {i}'s bytes differ from the output's"
    if not bool((cover == 1).all()):
        return (f"{key}: chunks cover {int((cover > 0).sum())} of {tensor.numel()} elements, "
                f"some twice: {bool((cover > 1).any())}")
    return None


def read_chunk(ckpt: Path, info):
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        blob = untransformed(f.read(min(info.length, 1 << 30)), info.transform_descriptors or ())
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def raw_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def first_difference(a, b, path):
    """The first difference between PyTorch's value `a` and the tool's `b`, or None."""
    where = path or "root"
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
        return None if torch.equal(raw_bytes(a), raw_bytes(b)) else f"{where}: tensor bytes differ"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)[:8]} vs {list(b)[:8]}"
        pairs = [(f"{path}[{k!r}]", a[k], b[k]) for k in a]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        pairs = [(f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    elif isinstance(a, float):
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"{where}: {a!r} vs {b!r}"
    else:
        try:
            same = bool(a == b)
        except Exception:
            same = False
        return None if same else f"{where}: {a!r:.200} vs {b!r:.200}"
    for sub, x, y in pairs:
        diff = first_difference(x, y, sub)
        if diff:
            return diff
    return None


# ---------------------------------------------------------------------------------------------
# One mutant: write it, run both sides, classify, keep or delete.


def classify(verify, consolidate, consolidate_err, torch_result):
    if verify.startswith("crash") or consolidate.startswith("crash"):
        return "CRASH"
    if verify != consolidate:
        return "VERIFY_MISMATCH"
    tool_ok = consolidate == "ok"
    if tool_ok and torch_result["ok"]:
        return "equal" if torch_result.get("diff") is None else "DISAGREE"
    if not tool_ok and not torch_result["ok"]:
        return "both_refuse"
    if not tool_ok and torch_result.get("lossy"):
        return "torch_lossy"
    if not tool_ok and "CRC-32 mismatch" in consolidate_err:
        # PyTorch never checks an archive's CRC-32: it reads a corrupt archive whatever the
        # damage, even where this damage happened to change no value it returns.
        torch_result["lossy"] = "PyTorch does not check the archive's CRC-32"
        return "torch_lossy"
    return "DISAGREE"


def run_mutant(index, fixture, description, changed, reference, args, workers, root):
    work = root / f"{index:05d}"
    ckpt = work / "ckpt"
    ckpt.mkdir(parents=True)
    for name, data in fixture.files.items():
        (ckpt / name).write_bytes(changed.get(name, data))
    tool_out = work / "tool.pt"
    verify, verify_err = run_tool(args.bin, "verify", ckpt)
    consolidate, consolidate_err = run_tool(args.bin, "consolidate", ckpt, tool_out)
    if consolidate == "ok" and not tool_out.is_file():
        consolidate = "crash: exit 0 without writing the output"
    worker = workers.get()
    try:
        torch_result = worker.run({"ckpt": str(ckpt), "torch_out": str(work / "torch.pt"),
                                   "tool_out": str(tool_out) if consolidate == "ok" else None,
                                   "reference": None if ".metadata" in changed else str(reference)})
    finally:
        workers.put(worker)
    outcome = classify(verify, consolidate, consolidate_err, torch_result)
    record = {"index": index, "fixture": fixture.name, "mutation": description, "outcome": outcome,
              "verify": {"status": verify, "stderr": verify_err},
              "consolidate": {"status": consolidate, "stderr": consolidate_err},
              "torch": torch_result}
    if outcome in REPORTED and args.keep:
        kept = Path(args.keep) / f"{index:05d}-{outcome}"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(ckpt, kept)
        record["kept"] = str(kept)
    shutil.rmtree(work)
    return record


def check_baseline(fixtures, args, workers, root):
    """PyTorch's output for each unmutated fixture (the reference for data file mutants), which
    must load without loss and come out equal, or the comparison itself is wrong."""
    references = {}
    for i, fixture in enumerate(fixtures):
        reference = root / f"{fixture.name}.reference.pt"
        worker = workers.get()
        try:
            answer = worker.run({"ckpt": str(fixture.path), "torch_out": str(reference),
                                 "tool_out": None, "reference": None})
        finally:
            workers.put(worker)
        record = run_mutant(-1 - i, fixture, "unmutated", {}, reference, args, workers, root)
        if not answer["ok"] or answer.get("lossy") or record["outcome"] != "equal":
            print(json.dumps({"torch": answer, **record}, indent=2), file=sys.stderr)
            raise SystemExit(2)
        references[fixture.name] = reference
    return references


def run_campaign(fixtures, references, args, workers, root):
    records, counts, per_fixture = [], Counter(), {f.name: Counter() for f in fixtures}
    started = time.monotonic()

    def task(index):
        rng = random.Random(f"{args.seed}:{index}")
        fixture = rng.choice(fixtures)
        description, changed = mutate(fixture, rng)
        reference = references[fixture.name]
        return run_mutant(index, fixture, description, changed, reference, args, workers, root)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(task, i) for i in range(args.count)]
        for done, future in enumerate(as_completed(futures), 1):
            record = future.result()
            counts[record["outcome"]] += 1
            per_fixture[record["fixture"]][record["outcome"]] += 1
            if record["outcome"] in REPORTED:
                records.append(record)
            if done % PROGRESS_EVERY == 0 or done == args.count:
                elapsed = time.monotonic() - started
                summary = ", ".join(f"{o} {counts[o]}" for o in OUTCOMES if counts[o])
                print(f"[{done}/{args.count}] {elapsed:.0f} s elapsed "
                      f"({elapsed / done:.3f} s/mutant): {summary}", flush=True)
    records.sort(key=lambda r: r["index"])
    return records, counts, per_fixture, time.monotonic() - started


def print_summary(counts, per_fixture, elapsed, count):
    width = max(len(name) for name in per_fixture)
    print(f"\n{count} mutants in {elapsed:.0f} s ({elapsed / max(count, 1):.3f} s/mutant)")
    for outcome in OUTCOMES:
        print(f"  {outcome:<16}{counts[outcome]:>7}")
    print("\n" + f"{'fixture':<{width}}" + "".join(f"{o:>17}" for o in OUTCOMES))
    for name, c in per_fixture.items():
        print(f"{name:<{width}}" + "".join(f"{c[o]:>17}" for o in OUTCOMES))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, default=REPO / "target/release/fsdp-ckpt",
                        help="the fsdp-ckpt binary")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=1000, help="number of mutants")
    parser.add_argument("--fixtures", default=DEFAULT_FIXTURES,
                        help="globs of DCP directories, relative to the repository root, "
                             "separated by commas")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel")
    parser.add_argument("--report", type=Path,
                        help="JSON report of the mutants not equal or both_refuse")
    parser.add_argument("--keep", type=Path,
                        help="copy torch_lossy/DISAGREE/VERIFY_MISMATCH/CRASH mutants here")
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.torch_worker:
        torch_worker()
        return
    args.bin = args.bin.resolve()
    if not os.access(args.bin, os.X_OK):
        raise SystemExit(f"no executable {args.bin} (cargo build --release -p fsdp-ckpt)")
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_LIMIT, DATA_LIMIT))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    fixtures = load_fixtures(args.fixtures)
    with tempfile.TemporaryDirectory(prefix="mutate-dcp-") as tmp:
        root = Path(tmp)
        binary, args.bin = args.bin, root / "fsdp-ckpt"
        shutil.copy2(binary, args.bin)
        workers = queue.Queue()
        for _ in range(args.jobs):
            workers.put(TorchWorker(root))
        try:
            references = check_baseline(fixtures, args, workers, root)
            records, counts, per_fixture, elapsed = run_campaign(fixtures, references, args,
                                                                 workers, root)
        finally:
            while not workers.empty():
                workers.get().stop()
    print_summary(counts, per_fixture, elapsed, args.count)
    if args.report:
        args.report.write_text(json.dumps({
            "binary": str(binary), "seed": args.seed, "count": args.count,
            "fixtures": [f.name for f in fixtures], "elapsed_seconds": round(elapsed, 1),
            "counts": {o: counts[o] for o in OUTCOMES},
            "per_fixture": {name: {o: c[o] for o in OUTCOMES} for name, c in per_fixture.items()},
            "mutants": records}, indent=1))
        print(f"report: {args.report}")
    sys.exit(1 if any(counts[o] for o in FAILING) else 0)


if __name__ == "__main__":
    main()

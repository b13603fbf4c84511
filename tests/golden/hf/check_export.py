"""Compare two Hugging Face model directories the way the `fsdp-ckpt convert --to hf` tests do.

    .venv/bin/python tests/golden/hf/check_export.py OUT_DIR REF_DIR [--bytes]

Checks, in this order, and stops at the first difference:

* the same set of `*.safetensors` file names;
* the same `*.safetensors.index.json` files, each equal as parsed JSON (or none in both);
* in each `.safetensors` file (names in sorted order): the same `__metadata__`, the same tensor
  names, and for each tensor (sorted by name) the same dtype, shape and data bytes.

With `--bytes` it also requires every `.safetensors` and index file to be byte-identical (header
key order, offsets, padding, JSON formatting). `config.json` and `generation_config.json` are
not compared.

Needs only the Python standard library. Exits 0 (prints `check_export: same`) or 1 with a
message naming the first difference.
"""

import json
import struct
import sys
from pathlib import Path


class Differ(Exception):
    pass


def read_safetensors(path):
    data = path.read_bytes()
    if len(data) < 8:
        raise Differ(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise Differ(f"{path}: header length {n} past the end of the file")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Differ(f"{path}: header is not JSON: {e}")
    meta = header.pop("__metadata__", None)
    body = data[8 + n :]
    tensors = {}
    for name, info in header.items():
        try:
            start, end = info["data_offsets"]
            tensors[name] = (info["dtype"], list(info["shape"]), body[start:end])
        except (KeyError, TypeError, ValueError) as e:
            raise Differ(f"{path}: bad header entry for {name!r}: {e!r}")
    return meta, tensors


def names(d, suffix):
    return sorted(p.name for p in d.iterdir() if p.is_file() and p.name.endswith(suffix))


def compare(out, ref, raw_bytes):
    for d in (out, ref):
        if not d.is_dir():
            raise Differ(f"{d}: not a directory")
    a, b = names(out, ".safetensors"), names(ref, ".safetensors")
    if a != b:
        raise Differ(
            f"safetensors files differ: only in OUT {sorted(set(a) - set(b))}, "
            f"only in REF {sorted(set(b) - set(a))}"
        )
    ia, ib = names(out, ".safetensors.index.json"), names(ref, ".safetensors.index.json")
    if ia != ib:
        raise Differ(f"index files differ: OUT has {ia}, REF has {ib}")
    for f in ia:
        try:
            ja = json.loads((out / f).read_text())
            jb = json.loads((ref / f).read_text())
        except json.JSONDecodeError as e:
            raise Differ(f"{f}: not JSON: {e}")
        if ja != jb:
            for key in sorted(set(ja) | set(jb)):
                if ja.get(key) != jb.get(key):
                    if isinstance(ja.get(key), dict) and isinstance(jb.get(key), dict):
                        for k in sorted(set(ja[key]) | set(jb[key])):
                            if ja[key].get(k) != jb[key].get(k):
                                raise Differ(
                                    f"{f}: {key}.{k} is {ja[key].get(k)!r} in OUT, "
                                    f"{jb[key].get(k)!r} in REF"
                                )
                    raise Differ(f"{f}: {key} is {ja.get(key)!r} in OUT, {jb.get(key)!r} in REF")
        if raw_bytes and (out / f).read_bytes() != (ref / f).read_bytes():
            raise Differ(f"{f}: same JSON but not byte-identical")
    for f in a:
        ma, ta = read_safetensors(out / f)
        mb, tb = read_safetensors(ref / f)
        if ma != mb:
            raise Differ(f"{f}: __metadata__ is {ma!r} in OUT, {mb!r} in REF")
        if sorted(ta) != sorted(tb):
            raise Differ(
                f"{f}: tensor names differ: only in OUT {sorted(set(ta) - set(tb))}, "
                f"only in REF {sorted(set(tb) - set(ta))}"
            )
        for name in sorted(ta):
            (da, sa, ba), (db, sb, bb) = ta[name], tb[name]
            if da != db:
                raise Differ(f"{f}: {name}: dtype {da} in OUT, {db} in REF")
            if sa != sb:
                raise Differ(f"{f}: {name}: shape {sa} in OUT, {sb} in REF")
            if ba != bb:
                first = next(i for i, (x, y) in enumerate(zip(ba, bb)) if x != y) if len(
                    ba
                ) == len(bb) else min(len(ba), len(bb))
                raise Differ(f"{f}: {name}: data bytes differ (first at byte {first})")
        if raw_bytes and (out / f).read_bytes() != (ref / f).read_bytes():
            raise Differ(f"{f}: same tensors but not byte-identical (header layout or padding)")


def main():
    args = [a for a in sys.argv[1:] if a != "--bytes"]
    if len(args) != 2:
        print("usage: check_export.py OUT_DIR REF_DIR [--bytes]", file=sys.stderr)
        sys.exit(2)
    try:
        compare(Path(args[0]), Path(args[1]), "--bytes" in sys.argv[1:])
    except Differ as e:
        print(f"check_export: DIFFERENT: {e}")
        sys.exit(1)
    print("check_export: same")


if __name__ == "__main__":
    main()

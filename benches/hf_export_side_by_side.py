"""PyTorch's side of `cargo bench --bench hf_export` (benches/hf_export.rs).

    python benches/hf_export_side_by_side.py make DCP_DIR HF_STORE_DIR MAPPING.json \
        --embed ROWS --hidden H --layers N --shard-bytes B
    python benches/hf_export_side_by_side.py torch_route DCP_DIR OUT_DIR TMP.pt --shard-bytes B
    python benches/hf_export_side_by_side.py consolidate HF_STORE_DIR OUT_DIR MAPPING.json
    python benches/hf_export_side_by_side.py baseline  # the interpreter and imports alone
    python benches/hf_export_side_by_side.py same OURS_DIR THEIRS_DIR [CONSOLIDATED_DIR]

`make` (untimed) builds a synthetic f32 model, an embedding [ROWS, H] (the largest tensor) and
N layers of a fused qkv [3H, H], an output projection [H, H], an MLP [4H, H] + [H, 4H] and a
norm [H], then a final norm [H]; it saves it twice:
- `dcp.save({"model": sd}, DCP_DIR, no_dist=True)`: a plain DCP directory, keys `model.*`,
  the crate's input;
- `dcp.save(sd, storage_writer=HuggingFaceStorageWriter(HF_STORE_DIR,
  fqn_to_index_mapping=M, save_distributed=True, enable_consolidation=False), no_dist=True)`:
  a DCP directory in Hugging Face storage, one rank's `shard-00001-model-0000i-of-0000N`
  files, input of `consolidate_safetensors_files`. M (written to MAPPING.json) maps each
  tensor to the file `split_torch_state_dict_into_shards(sd, max_shard_size=B)` puts it in,
  so that the consolidated files are the files of the same plan as ours.
It prints one JSON line: {"total_bytes", "largest", "tensors", "files"}.

The timed modes print one JSON line {"seconds": ..., "peak_rss": bytes}, the peak being this
process's ru_maxrss (the interpreter and torch included; `baseline` reports it for the
imports alone). The modules are imported before the clock starts.
- `torch_route`: PyTorch's own way from a DCP directory to a Hugging Face model directory:
  `dcp_to_torch_save` to TMP.pt, `torch.load` of it, the `model` subtree (the `model.` prefix
  stripped, as the crate does) split by `huggingface_hub.split_torch_state_dict_into_shards`
  and written shard by shard with `safetensors.torch.save_file(..., metadata={"format":
  "pt"})`, the index dumped as transformers' `save_pretrained` dumps it, every file and the
  directory fsynced (the crate's output is durable when it returns);
- `consolidate`: `torch.distributed.checkpoint._consolidate_hf_safetensors.
  consolidate_safetensors_files(HF_STORE_DIR, OUT_DIR, M)`, then every file and the
  directory fsynced.

`same` (untimed) checks that OURS_DIR and THEIRS_DIR hold the same files, the same index, and
in every .safetensors file the same metadata, tensor names (in order), dtypes, shapes and
bytes (read with `safetensors.safe_open`); it prints "outputs equal" and whether the files
are byte-identical. With CONSOLIDATED_DIR it also reports whether
`consolidate_safetensors_files` put the same tensors (names, dtypes, shapes, bytes) in
files of the same names (its headers carry no {"format": "pt"} and its index no
total_parameters, so its files are not compared byte for byte).
"""
import filecmp
import json
import os
import resource
import sys
import time

import torch


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))


def opt(args, name):
    return int(args[args.index(name) + 1])


def model(embed, hidden, layers):
    g = torch.Generator().manual_seed(0)
    h = hidden
    shapes = [("embed_tokens.weight", (embed, h))]
    for i in range(layers):
        shapes += [
            (f"layers.{i}.attn.qkv.weight", (3 * h, h)),
            (f"layers.{i}.attn.o.weight", (h, h)),
            (f"layers.{i}.mlp.up.weight", (4 * h, h)),
            (f"layers.{i}.mlp.down.weight", (h, 4 * h)),
            (f"layers.{i}.norm.weight", (h,)),
        ]
    shapes.append(("norm.weight", (h,)))
    return {name: torch.randn(shape, generator=g) for name, shape in shapes}


def make(dcp_dir, store_dir, mapping_path, embed, hidden, layers, shard_bytes):
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import split_torch_state_dict_into_shards
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sd = model(embed, hidden, layers)
    dcp.save({"model": sd}, checkpoint_id=dcp_dir, no_dist=True)
    split = split_torch_state_dict_into_shards(
        sd, filename_pattern="model{suffix}.safetensors", max_shard_size=shard_bytes
    )
    files = list(split.filename_to_tensors)
    mapping = {
        name: i
        for i, f in enumerate(files, start=1)
        for name in split.filename_to_tensors[f]
    }
    writer = HuggingFaceStorageWriter(
        store_dir,
        fqn_to_index_mapping=mapping,
        save_distributed=True,
        enable_consolidation=False,
    )
    dcp.save(sd, storage_writer=writer, no_dist=True)
    with open(mapping_path, "w") as f:
        json.dump({"mapping": mapping, "files": files}, f)
    sizes = [t.numel() * t.element_size() for t in sd.values()]
    print(json.dumps({"total_bytes": sum(sizes), "largest": max(sizes),
                      "tensors": len(sizes), "files": len(files)}))


def fsync_dir(d):
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_route(dcp_dir, out_dir, tmp_pt, shard_bytes):
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dir, tmp_pt)
    sd = torch.load(tmp_pt, weights_only=True)["model"]  # the `model.` prefix stripped
    split = split_torch_state_dict_into_shards(
        sd, filename_pattern="model{suffix}.safetensors", max_shard_size=shard_bytes
    )
    # save_pretrained's total_parameters: model.num_parameters(), every element (no ties here).
    total_parameters = sum(t.numel() for t in sd.values())
    os.makedirs(out_dir, exist_ok=True)
    # As save_pretrained: each shard's tensors popped from the state dict, then written.
    for shard_file, names in split.filename_to_tensors.items():
        shard = {name: sd.pop(name).contiguous() for name in names}
        save_file(shard, os.path.join(out_dir, shard_file), metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": total_parameters, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w",
                  encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    fsync_dir(out_dir)


def consolidate(store_dir, out_dir, mapping_path):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    with open(mapping_path) as f:
        mapping = json.load(f)["mapping"]
    os.makedirs(out_dir, exist_ok=True)
    consolidate_safetensors_files(store_dir, out_dir, mapping)
    fsync_dir(out_dir)


def tensors_of(d):
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(d)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(d, name), framework="pt") as f:
            keys = list(f.keys())
            out[name] = (f.metadata(), keys, {k: f.get_tensor(k) for k in keys})
    return out


def same_tensors(a, b, what):
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 (NaNs compare too)
    assert sorted(a) == sorted(b), f"{what}: files {sorted(a)} vs {sorted(b)}"
    for name in a:
        (_, ka, ta), (_, kb, tb) = a[name], b[name]
        assert sorted(ka) == sorted(kb), f"{what}: {name}: tensors differ"
        for k in ka:
            x, y = ta[k], tb[k]
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {name}:{k}"
            assert torch.equal(bits(x), bits(y)), f"{what}: {name}:{k}: bytes differ"


def same(ours, theirs, consolidated=None):
    names = sorted(os.listdir(ours))
    assert names == sorted(os.listdir(theirs)), (
        f"files differ: {names} vs {sorted(os.listdir(theirs))}")
    index = "model.safetensors.index.json"
    if index in names:
        with open(os.path.join(ours, index)) as f, open(os.path.join(theirs, index)) as g:
            assert json.load(f) == json.load(g), "indexes differ"
    a, b = tensors_of(ours), tensors_of(theirs)
    for name in a:
        assert a[name][0] == b[name][0], f"{name}: metadata {a[name][0]} vs {b[name][0]}"
        assert a[name][1] == b[name][1], f"{name}: tensor order differs"
    same_tensors(a, b, "PyTorch route")
    identical = all(filecmp.cmp(os.path.join(ours, n), os.path.join(theirs, n), shallow=False)
                    for n in names)
    print(f"outputs equal: {len(a)} files, {sum(len(v[1]) for v in a.values())} tensors, "
          f"same names, metadata, index, dtypes, shapes and bytes; files "
          f"{'byte-identical' if identical else 'NOT byte-identical'}")
    del b
    if consolidated is not None:
        c = tensors_of(consolidated)
        try:
            same_tensors(a, c, "consolidate_safetensors_files")
            print("consolidate_safetensors_files output: the same tensors in files of the "
                  "same names")
        except AssertionError as e:
            print(f"consolidate_safetensors_files output differs: {e}")


def preload():
    """The modules the timed modes use, imported before the clock starts."""
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint._consolidate_hf_safetensors  # noqa: F401
    import torch.distributed.checkpoint.format_utils  # noqa: F401


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode in ("torch_route", "consolidate", "baseline"):
        preload()
    if mode == "make":
        make(args[0], args[1], args[2], opt(args, "--embed"), opt(args, "--hidden"),
             opt(args, "--layers"), opt(args, "--shard-bytes"))
    elif mode == "torch_route":
        timed(torch_route, args[0], args[1], args[2], opt(args, "--shard-bytes"))
    elif mode == "consolidate":
        timed(consolidate, args[0], args[1], args[2])
    elif mode == "baseline":
        timed(lambda: None)
    elif mode == "same":
        same(args[0], args[1], args[2] if len(args) > 2 else None)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()

"""Hugging Face model directories from REAL PyTorch 2.13 + transformers 5.24.0 (huggingface_hub
2.4.0, safetensors 0.8.0), and the DCP training checkpoints they come from, for
`fsdp-ckpt convert IN OUT_DIR --to hf` (export, byte-compatible with `save_pretrained`) and
`fsdp-ckpt convert HF_DIR OUT --to dcp` (import).

Run manually from the crate root with the project's venv, and commit the output:

    .venv/bin/python tests/golden/hf/gen.py                # every scenario
    .venv/bin/python tests/golden/hf/gen.py llama_tied     # some

Nothing is downloaded: each scenario builds a tiny `LlamaForCausalLM` from a `LlamaConfig`
(vocab 128, hidden 32, intermediate 104, 2 layers, 4 heads, 2 key/value heads, head_dim 8,
max positions 64) after `torch.manual_seed(0)`. Its weights are 34464 float32 elements
(137856 bytes) untied and 30368 unique elements (121472 bytes) tied, so that
`max_shard_size="60KB"` (60000 bytes) gives 3 files in float32 and 2 in bfloat16 for both.

It spawns 2 ranks with `torch.multiprocessing` (gloo, 127.0.0.1, a free port), wraps the model
with FSDP2 `fully_shard` (`init_device_mesh("cpu", (2,))`, each decoder layer, then the root),
runs one AdamW step on a fixed random batch (so the optimizer state exists) and writes
`tests/golden/hf/<scenario>/`:

* `llama_untied/`, `llama_tied/` (`tie_word_embeddings` False / True), each with
  * `dcp/` — `dcp.save({"model": msd, "optim": osd}, checkpoint_id="dcp")` of
    `get_state_dict(model, optim)`: `.metadata`, `__0_0.distcp`, `__1_0.distcp`. Checked here:
    its `model.` entries (read back by PyTorch) equal the full model state dict.
  * `hf_60KB/` — `save_pretrained(dir, max_shard_size="60KB")` of a fresh, plain (non-FSDP)
    `LlamaForCausalLM` of the same config into which the saving run's full state dict
    (`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))`) was loaded: `config.json`, `generation_config.json`,
    `model-0000{1,2,3}-of-00003.safetensors`, `model.safetensors.index.json`.
  * `hf_60KB_bf16/` — the same after `.to(torch.bfloat16)`: 2 files and an index.
  * `hf_default/` — `save_pretrained(dir)` (max_shard_size "50GB"): `model.safetensors`,
    no index.
  * `hf_15KB/` (untied only) — `save_pretrained(dir, max_shard_size="15KB")`: the embedding
    and the head are each larger than the limit and get files of their own, appended while
    the file being filled stays open.
  * `state_dict.pt` — `torch.save(model.state_dict())` of the plain model, float32. For the
    tied model `lm_head.weight` and `model.embed_tokens.weight` are one storage in this file
    (checked here, also after `torch.load`).
  * `logits.pt` — `{"input_ids": int64 [2, 8], "logits": float32 [2, 8, 128]}`: the plain
    model's logits (eval, no grad, 1 thread) on fixed input ids. `load_check.py` checks a
    DCP against it.

Observed with these versions (asserted by `observe` on every run where marked *):

(a) The DCP `.metadata` `state_dict_metadata` key order: the `model.` keys come first, in
    exactly `model.state_dict()` order prefixed with `model.` * (not sorted). Then the optimizer:
    `exp_avg`, `exp_avg_sq` per parameter (parameter order), then all the `step` entries, then
    `param_groups.0.{lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable,
    differentiable, fused, decoupled_weight_decay, params}` (bytes). The order is the merge of
    the ranks' save plans: the replicated `step` tensors and `param_groups` values are written
    by rank 1 only (deduplicated into `__1_0.distcp`), so they come after rank 0's items.
    96 keys untied, 93 tied.
    Both models list all 21 `model.` keys, the tied one too: `model.lm_head.weight` is in the
    DCP as its own chunks (same bytes as `model.model.embed_tokens.weight`), and
    `get_model_state_dict` (sharded or full) returns both keys *, so a DCP imported from an HF
    directory must hold `model.lm_head.weight` for `dcp.load` of the tied model to succeed
    (`load_check.py` then fails with "Missing key in checkpoint state_dict:
    model.lm_head.weight."). The tied model's optimizer state has one entry per unique
    parameter (20, no `lm_head.weight`), the untied one 21 *.
    Each DCP item is a separate `torch.save` zip (about 1.5 KB of overhead per item per
    rank), so `dcp/` is about 700 KB although the model + AdamW state is 3 x 138 KB.
(b) For the tied model `save_pretrained` drops `lm_head.weight` (only) *: every reference
    directory of `llama_tied` holds 20 tensors, of `llama_untied` 21.
(c) `config.json` contains `"tie_word_embeddings"` explicitly for both models (`false` /
    `true`) *. It also has `"dtype": "float32"` (`"bfloat16"` in `hf_60KB_bf16`, the only
    difference between those two configs) and `"architectures": ["LlamaForCausalLM"]`; it is
    `json.dumps(config, indent=2, sort_keys=True) + "\n"` *.
(d) `model.safetensors.index.json` is `json.dumps(index, indent=2, sort_keys=True) + "\n"`
    (`PreTrainedModel.save_pretrained`) *, so `weight_map` is sorted by tensor name:
    `{"metadata": {"total_parameters": N, "total_size": B}, "weight_map": {name: file}}`.
    `total_size` is the sum of the saved tensors' bytes (huggingface_hub
    `split_state_dict_into_shards_factory`, which sizes by `untyped_storage().nbytes()` and
    counts a storage shared by several tensors once); `total_parameters` is
    `model.num_parameters()`, the unique parameters, equal here to the element count of the
    saved tensors for both models *: 34464 / 137856 (bf16 68928) untied, 30368 / 121472
    (bf16 60736) tied.
(e) Each `.safetensors` file (safetensors 0.8.0 `save_file`, metadata `{"format": "pt"}` *):
    the header JSON is compact (no spaces), `__metadata__` first, then the tensors sorted by
    name, padded with spaces to a multiple of 8 bytes *; the data is laid out in that same
    name order, back to back from offset 0 * (safetensors sorts by dtype alignment first, then
    name; all tensors here share one dtype). Files are 0600 as written by safetensors.
    Which file a tensor goes to: greedily in `model.state_dict()` order *, a new file when the
    next tensor would take the current one past 60000 bytes (a tensor bigger than the limit
    would get a file of its own, appended BEFORE the file being filled — not the case here).
    Files per directory: `hf_default` 1 (`model.safetensors`, no index), `hf_60KB` 3
    (7 / 9 / 5 tensors untied, 7 / 9 / 4 tied), `hf_60KB_bf16` 2 (16 / 5 untied, 16 / 4 tied).

"""

import copy
import json
import os
import shutil
import socket
import struct
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)

ROOT = Path(__file__).resolve().parent
WS = 2
SHARD = "60KB"

SCENARIOS = {
    # name: tie_word_embeddings
    "llama_untied": False,
    "llama_tied": True,
}


def make_config(tied):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=104,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def wrap(model, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank, ws, port, name, out):
    from transformers import LlamaForCausalLM

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    torch.manual_seed(0)
    config = make_config(SCENARIOS[name])
    model = wrap(LlamaForCausalLM(config), ws)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    optim.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    os.chdir(out)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id="dcp")
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save(
            {"full": full, "sharded_keys": list(msd), "optim_keys": list(osd["state"])},
            out / "full.pt",
        )
    dist.barrier()
    if rank == 0:
        (out / "done").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw(t):
    return t.detach().contiguous().flatten().view(torch.uint8)


def same_tensors(a, b):
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(raw(a[k]), raw(b[k]))
        for k in a
    )


def read_dcp(ckpt):
    """PyTorch's reading of a DCP directory into a plain (nested) dict, as `dcp_to_torch_save`."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {}
    _load_state_dict(
        sd,
        storage_reader=dcp.FileSystemReader(str(ckpt)),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return sd


def run(name):
    out = ROOT / name
    for attempt in range(4):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        try:
            mp.spawn(worker, args=(WS, free_port(), name, out), nprocs=WS, join=True)
        except Exception as e:  # gloo sometimes aborts a process at exit after the work
            print(f"{name}: attempt {attempt} raised {e!r}", file=sys.stderr)
        if (out / "done").exists():
            break
    else:
        raise SystemExit(f"{name}: no complete checkpoint after 4 attempts")
    (out / "done").unlink()
    saved = torch.load(out / "full.pt", weights_only=True)
    (out / "full.pt").unlink()
    references(name, out, saved)
    observe(name, out, saved)
    print(f"{name}: ok")


def references(name, out, saved):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    full = saved["full"]
    tied = SCENARIOS[name]
    config = make_config(tied)
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(full)
    plain.eval()
    sd = plain.state_dict()
    assert list(sd) == list(full), "full state dict order differs from the plain model's"
    assert same_tensors(sd, full)

    # The DCP's model entries are the full state dict.
    got = read_dcp(out / "dcp")
    assert same_tensors(got["model"], full), f"{name}: DCP model entries differ"

    plain.save_pretrained(out / "hf_default")
    plain.save_pretrained(out / f"hf_{SHARD}", max_shard_size=SHARD)
    if not tied:
        # Embedding and head (16384 bytes each) exceed 15 KB: each is appended at once as a
        # file of its own while the file being filled stays open, so file numbers do not
        # follow state_dict order.
        plain.save_pretrained(out / "hf_15KB", max_shard_size="15KB")
    torch.save(sd, out / "state_dict.pt")
    if tied:
        back = torch.load(out / "state_dict.pt", weights_only=True)
        for d in (sd, back):
            assert (
                d["lm_head.weight"].untyped_storage().data_ptr()
                == d["model.embed_tokens.weight"].untyped_storage().data_ptr()
            ), "tied weights are not one storage in state_dict.pt"
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    with torch.no_grad():
        logits = plain(input_ids=ids).logits.float()
    torch.save({"input_ids": ids, "logits": logits}, out / "logits.pt")

    bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    bf16.save_pretrained(out / f"hf_{SHARD}_bf16", max_shard_size=SHARD)


def st_header(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8 : 8 + n].decode("utf-8")


def observe(name, out, saved):
    """Print (and assert) what the module docstring records."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    tied = SCENARIOS[name]
    full = saved["full"]
    order = list(full)
    print(f"--- {name}")

    # (a) DCP metadata key order.
    md = FileSystemReader(str(out / "dcp")).read_metadata()
    keys = list(md.state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    print("(a) metadata keys == model.+state_dict order:", model_keys == ["model." + k for k in order])
    print("    metadata keys sorted:", keys == sorted(keys))
    print("    first keys:", keys[:4])
    assert model_keys == ["model." + k for k in order]
    assert keys[: len(order)] == model_keys  # the model entries first
    assert sorted(model_keys) == sorted("model." + k for k in order)
    assert sorted(saved["sharded_keys"]) == sorted(order)
    print("    sharded get_state_dict model keys:", len(saved["sharded_keys"]),
          "optim state keys:", len(saved["optim_keys"]))
    assert ("lm_head.weight" in saved["optim_keys"]) == (not tied)
    params = saved["optim_keys"]
    groups = ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
              "capturable", "differentiable", "fused", "decoupled_weight_decay", "params"]
    assert keys[len(order):] == (
        [f"optim.state.{p}.{s}" for p in params for s in ("exp_avg", "exp_avg_sq")]
        + [f"optim.state.{p}.step" for p in params]
        + [f"optim.param_groups.0.{g}" for g in groups]
    ), "optimizer key order changed"
    assert {
        v.relative_path
        for k, v in md.storage_data.items()
        if k.fqn.endswith(".step") or ".param_groups." in k.fqn
    } == {"__1_0.distcp"}
    assert len(order) == 21

    # (b) dropped keys, (c) config, (d) index, (e) safetensors layout.
    for ref in ("hf_default", f"hf_{SHARD}", f"hf_{SHARD}_bf16"):
        d = out / ref
        files = sorted(p.name for p in d.iterdir())
        print(f"  {ref}: {files}")
        names = []
        for f in sorted(d.glob("*.safetensors")):
            n, header = st_header(f)
            h = json.loads(header)
            hkeys = list(json.loads(header, object_pairs_hook=lambda kv: [k for k, _ in kv]))
            tensors = [k for k in hkeys if k != "__metadata__"]
            by_offset = sorted(tensors, key=lambda k: h[k]["data_offsets"][0])
            print(f"    {f.name}: header {n} bytes, {len(tensors)} tensors,"
                  f" metadata {h['__metadata__']}, header keys sorted {tensors == sorted(tensors)},"
                  f" data order == header order {by_offset == tensors},"
                  f" __metadata__ first {hkeys[0] == '__metadata__'}, compact {': ' not in header},"
                  f" padding {len(header) - len(header.rstrip(' '))}")
            assert hkeys[0] == "__metadata__" and tensors == sorted(tensors)
            assert by_offset == tensors and h["__metadata__"] == {"format": "pt"}
            assert n % 8 == 0
            end = 0
            for k in tensors:
                assert h[k]["data_offsets"][0] == end
                end = h[k]["data_offsets"][1]
            with safe_open(str(f), framework="pt") as s:
                names += list(s.keys())
        dropped = sorted(set(order) - set(names))
        print("    dropped by save_pretrained:", dropped)
        assert dropped == (["lm_head.weight"] if tied else [])
        # Files are filled greedily in state_dict order.
        assert [k for k in order if k in names] == sum(
            (st_tensor_order_by_file(d, order)), []
        )
        want_files = {"hf_default": 1, f"hf_{SHARD}": 3, f"hf_{SHARD}_bf16": 2}[ref]
        assert len(st_files(d)) == want_files, f"{ref}: {len(st_files(d))} files"
        assert len(names) == (20 if tied else 21)
        cfg_text = (d / "config.json").read_text()
        cfg = json.loads(cfg_text)
        print("    config tie_word_embeddings:", cfg.get("tie_word_embeddings", "ABSENT"),
              "dtype:", cfg.get("dtype"))
        assert cfg["tie_word_embeddings"] is tied
        assert cfg_text == json.dumps(cfg, indent=2, sort_keys=True) + "\n"
        f32_cfg = json.loads((out / "hf_default" / "config.json").read_text())
        want_dtype = "bfloat16" if ref.endswith("bf16") else "float32"
        assert cfg == {**f32_cfg, "dtype": want_dtype}
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        index = d / "model.safetensors.index.json"
        if index.exists():
            text = index.read_text()
            idx = json.loads(text)
            assert text == json.dumps(idx, indent=2, sort_keys=True) + "\n"
            st = {}
            for f in sorted(d.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as s:
                    st.update({k: s.get_tensor(k) for k in s.keys()})
            elements = sum(t.numel() for t in st.values())
            nbytes = sum(t.numel() * t.element_size() for t in st.values())
            print("    index metadata:", idx["metadata"], "elements", elements, "bytes", nbytes)
            assert idx["metadata"] == {"total_parameters": elements, "total_size": nbytes}
            assert idx["weight_map"] == {k: f for f in st_files(d) for k in st_names(d / f)}
        else:
            print("    no index")
            assert files == ["config.json", "generation_config.json", "model.safetensors"]


def st_files(d):
    return sorted(p.name for p in Path(d).glob("*.safetensors"))


def st_names(path):
    _, header = st_header(path)
    return [k for k in json.loads(header) if k != "__metadata__"]


def st_tensor_order_by_file(d, order):
    """Each file's tensors in `order` (state_dict order), files in name order."""
    return [[k for k in order if k in set(st_names(d / f))] for f in st_files(d)]


def main():
    names = sys.argv[1:] or list(SCENARIOS)
    for name in names:
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    for name in names:
        run(name)


if __name__ == "__main__":
    main()

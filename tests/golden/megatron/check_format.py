"""Checks FORMAT.md against the Megatron fixtures WITHOUT Megatron (torch 2.13 + safetensors).

    .venv/bin/python tests/golden/megatron/check_format.py            # every check
    .venv/bin/python tests/golden/megatron/check_format.py --globals  # also print the globals

1. Lists every Python global (module.qualname) that the pickles of each fixture name: `.metadata`,
   `common.pt` (0.16), every bytes item of the `.distcp` files (each a `torch.save` zip whose
   `data.pkl` is read), Bridge's `train_state.pt`; and for each global whether torch/Python
   defines it as a dataclass (fields in order) or an enum (members), and how the pickle builds
   it (call arity, BUILD state). Nothing is imported from the pickles: a recording Unpickler
   returns stubs.
2. `dcp_to_torch_save` of every fixture gives exactly `expected.safetensors`' tensors.
3. The dp_reshardable bucket rule (FORMAT.md section 5): from the model keys and shapes of
   `.metadata`, the bytes items `per_bucket_numel` / `per_bucket_numel_unpadded` and the fixed
   parameter order of the local GPT layer spec, computes where each parameter lies in each
   bucket, checks it against Megatron's own account (case.json), and rebuilds every parameter's
   exp_avg / exp_avg_sq / fp32 master from the flat buckets; compares them with the same run
   saved as fully_reshardable / plain (and dp_zero_gather_scatter). Alignment gaps are never read.
"""

import collections
import dataclasses
import enum
import hashlib
import importlib
import io
import json
import os
import pickle
import re
import sys
import tempfile
import zipfile

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------------------------
# 1. Globals
# --------------------------------------------------------------------------------------------
class _Recorder(pickle.Unpickler):
    def __init__(self, f, seen):
        super().__init__(f)
        self.seen = seen

    def find_class(self, module, name):
        key = f"{module}.{name}"
        info = self.seen.setdefault(key, {"calls": set(), "states": set()})

        class Stub:
            def __new__(cls, *a, **k):
                info["calls"].add(len(a))
                return object.__new__(cls)

            def __init__(self, *a, **k):
                pass

            def __setstate__(self, st):
                info["states"].add(describe_state(st))

            def __call__(self, *a, **k):  # a global used as a function (e.g. a rebuild fn)
                info["calls"].add(len(a))
                return Stub.__new__(Stub)

        Stub.__qualname__ = key
        return Stub

    def persistent_load(self, pid):
        return None


def describe_state(st):
    if isinstance(st, dict):
        return "dict{" + ",".join(map(str, st.keys())) + "}"
    if isinstance(st, tuple):
        return "tuple(" + ",".join(describe_state(x) for x in st) + ")"
    if st is None:
        return "None"
    return type(st).__name__


def pickles_of(raw):
    """The pickles inside one blob: itself, or a torch.save zip's data.pkl."""
    if raw[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            return [z.read(n) for n in z.namelist() if n.endswith("data.pkl")]
    return [raw]


def record_globals(raw, seen):
    for p in pickles_of(raw):
        _Recorder(io.BytesIO(p), seen).load()


def kind_of(key):
    module, _, name = key.rpartition(".")
    # qualnames with dots (nested) are not expected; try progressively shorter modules
    try:
        obj = importlib.import_module(module)
        obj = getattr(obj, name)
    except Exception:  # noqa: BLE001
        return "not importable here"
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return "enum " + ", ".join(f"{m.name}={m.value!r}" for m in obj)
    if dataclasses.is_dataclass(obj):
        fs = dataclasses.fields(obj)
        return "dataclass(" + ", ".join(f.name for f in fs) + ")" + (
            " slots" if hasattr(obj, "__slots__") else "")
    if isinstance(obj, type):
        return "class " + ",".join(b.__module__ + "." + b.__qualname__ for b in obj.__mro__[1:])
    return type(obj).__name__


def fixture_dirs():
    out = []
    for ver in sorted(os.listdir(HERE)):
        if ver.startswith("v") and os.path.isdir(os.path.join(HERE, ver)):
            for case in sorted(os.listdir(os.path.join(HERE, ver))):
                out.append(os.path.join(HERE, ver, case))
    return out


def checkpoint_dir(root):
    t = os.path.join(root, "latest_checkpointed_iteration.txt")
    if os.path.exists(t):
        it = open(t).read().strip()
        return os.path.join(root, "release" if it == "release" else f"iter_{int(it):07d}")
    return root


def read_metadata(ckpt):
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(ckpt).read_metadata()


def bytes_items(ckpt, meta):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    out = {}
    for k, v in meta.state_dict_metadata.items():
        if isinstance(v, BytesStorageMetadata):
            info = meta.storage_data[MetadataIndex(k)]
            with open(os.path.join(ckpt, info.relative_path), "rb") as f:
                f.seek(info.offset)
                out[k] = f.read(info.length)
    return out


def check_globals(show):
    where = collections.defaultdict(lambda: collections.defaultdict(set))
    for d in fixture_dirs():
        ckpt = checkpoint_dir(os.path.join(d, "ckpt"))
        rel = os.path.relpath(d, HERE)
        sources = {".metadata": open(os.path.join(ckpt, ".metadata"), "rb").read()}
        if os.path.exists(os.path.join(ckpt, "common.pt")):
            sources["common.pt"] = open(os.path.join(ckpt, "common.pt"), "rb").read()
        for extra in ("train_state.pt",):
            if os.path.exists(os.path.join(ckpt, extra)):
                sources[extra] = open(os.path.join(ckpt, extra), "rb").read()
        meta = read_metadata(ckpt)
        for k, raw in bytes_items(ckpt, meta).items():
            base = re.sub(r"dp_group_idx_\d+", "dp_group_idx_<i>", k.split("/")[0])
            base = re.sub(r"^decoder\.layers\..*\._extra_state$", "<layer>._extra_state", base)
            sources["item " + base] = raw
        for src, raw in sources.items():
            seen = {}
            record_globals(raw, seen)
            for g, info in seen.items():
                group = ".metadata" if src == ".metadata" else src
                where[g]["in"].add(group)
                where[g]["calls"] |= info["calls"]
                where[g]["states"] |= info["states"]
                where[g]["fixtures"].add(rel)
    if show:
        for g in sorted(where):
            w = where[g]
            print(f"{g}\n    kind: {kind_of(g)}\n    in: {sorted(w['in'])}\n"
                  f"    calls(argc): {sorted(w['calls'])} BUILD: {sorted(w['states'])}")
    return where


# --------------------------------------------------------------------------------------------
# 2. dcp_to_torch_save == expected.safetensors
# --------------------------------------------------------------------------------------------
def flat(prefix, v, out):
    if isinstance(v, dict):
        for k, x in v.items():
            flat(f"{prefix}.{k}" if prefix else k, x, out)
    else:
        out[prefix] = v


def dcp_tensors(ckpt):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as t:
        p = os.path.join(t, "x.pt")
        dcp_to_torch_save(ckpt, p)
        sd = torch.load(p, weights_only=False)
    out = {}
    flat("", sd, out)
    return out


def check_expected(d):
    ckpt = checkpoint_dir(os.path.join(d, "ckpt"))
    got = {k: v for k, v in dcp_tensors(ckpt).items() if isinstance(v, torch.Tensor)}
    want = load_file(os.path.join(d, "expected.safetensors"))
    assert set(got) == set(want), (d, set(got) ^ set(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8) if got[k].dim() else got[k], want[k].view(torch.uint8) if want[k].dim() else want[k]), k


# --------------------------------------------------------------------------------------------
# 3. The dp_reshardable bucket rule
# --------------------------------------------------------------------------------------------
# Parameter order of one TransformerLayer built from get_gpt_layer_local_spec (module
# registration order: input_layernorm, self_attention{linear_proj, linear_qkv},
# pre_mlp_layernorm, mlp{linear_fc1, linear_fc2}), each with the checkpoint key it is saved
# under (the local spec's norms are saved as the TE-fused names) and its TP split.
LOCAL_LAYER = [
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", None),
    ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight", "row"),
    ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight", "col"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", None),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight", "glu"),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", "row"),
]


def pad(x, m):
    return (x + m - 1) // m * m


def model_params(shapes, tp, pp, pp_rank, tied):
    """[(param name, ckpt key, layer index or None, split, local shape)] in named_parameters
    order of the GPTModel on this (tp, pp) rank; shapes: ckpt key -> global shape."""
    n_layers = shapes["decoder.layers.self_attention.linear_qkv.weight"][0]
    per_stage = n_layers // pp
    out = []

    def local(key, split, layer):
        s = list(shapes[key])
        if layer is not None:
            s = s[1:]
        if split in ("col", "glu"):
            s[0] //= tp
        elif split == "row":
            s[1] //= tp
        return tuple(s)

    if pp_rank == 0:
        k = "embedding.word_embeddings.weight"
        out.append((k, k, None, "col", local(k, "col", None)))
    for i in range(per_stage):
        g = pp_rank * per_stage + i
        for name, key, split in LOCAL_LAYER:
            ck = "decoder.layers." + key
            out.append((f"decoder.layers.{i}.{name}", ck, g, split, local(ck, split, g)))
    if pp_rank == pp - 1:
        k = "decoder.final_layernorm.weight"
        out.append((k, k, None, None, local(k, None, None)))
        if "output_layer.weight" in shapes:
            out.append(("output_layer.weight", "output_layer.weight", None, "col",
                        local("output_layer.weight", "col", None)))
        elif tied and pp > 1:
            # the last stage's copy of the tied embedding (shared_embedding): a parameter in
            # the buffer (its own bucket) that the model-space keys do not save
            k = "embedding.word_embeddings.weight"
            out.append(("output_layer.weight", None, None, "col", local(k, "col", None)))
    return out


def layout(params, numel_unpadded, numel, shared_last):
    """Megatron's rule (optimizer/param_layout.py + distrib_optimizer.py
    _compute_per_buffer_param_layout): iterate the parameters in REVERSE; each starts at the
    next multiple of 64 elements; a bucket closes after the parameter whose end reaches
    per_bucket_numel_unpadded[k] past the bucket start (equivalently: bucket_size reached, or a
    shared embedding); the next bucket starts at bucket start + per_bucket_numel[k] (the end
    padded to lcm(DP, 128)). Returns name -> (bucket, start, end) in bucket coordinates."""
    pos = {}
    b, bucket_start, cursor = 0, 0, 0
    for name, _key, _layer, _split, shape in reversed(params):
        n = 1
        for s in shape:
            n *= s
        start = pad(cursor, 64)
        shared = shared_last and name == "output_layer.weight"
        end = start + n
        pos[name] = (b, start - bucket_start, end - bucket_start)
        if end - bucket_start == numel_unpadded[b] or shared:
            assert end - bucket_start == numel_unpadded[b]
            bucket_start += numel[b]
            cursor = bucket_start
            b += 1
        else:
            cursor = end
    assert b == len(numel), (b, numel)
    return pos


def to_global(local_flat, shape_local, split, tp, tp_rank, shape_global, layer, dest):
    """Writes one TP rank's parameter (flat) into the global tensor `dest` (the model key's
    global shape)."""
    t = local_flat.view(shape_local)
    d = dest[layer] if layer is not None else dest
    if split is None:
        if tp_rank == 0:
            d.copy_(t)
    elif split == "col":
        r = t.shape[0]
        d[tp_rank * r:(tp_rank + 1) * r].copy_(t)
    elif split == "row":
        c = t.shape[1]
        d[:, tp_rank * c:(tp_rank + 1) * c].copy_(t)
    elif split == "glu":
        half = t.shape[0] // 2
        f = d.shape[0] // 2
        d[tp_rank * half:(tp_rank + 1) * half].copy_(t[:half])
        d[f + tp_rank * half:f + (tp_rank + 1) * half].copy_(t[half:])


def unflatten_dp_reshardable(d):
    """-> {state: {ckpt key: tensor}} rebuilt from the buckets with the rule above."""
    ckpt = checkpoint_dir(os.path.join(d, "ckpt"))
    meta = read_metadata(ckpt)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    shapes = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")}
    items = bytes_items(ckpt, meta)
    tensors = load_file(os.path.join(d, "expected.safetensors"))
    case = json.load(open(os.path.join(d, "case.json")))
    tp, pp = case["tp"], case["pp"]
    tied = "output_layer.weight" not in shapes
    out = collections.defaultdict(dict)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            idx = pp_rank * tp + tp_rank  # rank in the model-parallel group (TP fastest)
            pre = f"optimizer.distributed.dp_group_idx_{idx}"
            numel = torch.load(io.BytesIO(items[pre + ".per_bucket_numel/shard_0_1"]),
                               weights_only=False)[0]
            unpadded = torch.load(io.BytesIO(items[pre + ".per_bucket_numel_unpadded/shard_0_1"]),
                                  weights_only=False)[0]
            params = model_params(shapes, tp, pp, pp_rank, tied)
            assert len(numel) == 1, "one buffer (gbuf_idx_0) in these fixtures"
            (dtypes, nb), = numel[0].items()
            (_, nbu), = unpadded[0].items()
            pos = layout(params, nbu, nb, tied and pp > 1 and pp_rank == pp - 1)
            # Megatron's own account (recorded by gen.py) must agree
            for r in case["ranks"]:
                if r["tp_rank"] == tp_rank and r["pp_rank"] == pp_rank:
                    buf = r["buffers"][0]
                    offs = [bk["offset"] for bk in buf["buckets"]]
                    for p in buf["params"]:
                        b, s, e = pos[p["name"].removeprefix("module.")]
                        assert (b, s + offs[b], e + offs[b]) == (p["bucket"], p["start"], p["end"]), p
            dt = f"dtype_({dtypes[0]}, {dtypes[1]})"
            for state in ("param", "exp_avg", "exp_avg_sq"):
                for name, key, layer, split, shape in params:
                    if key is None:
                        continue
                    b, s, e = pos[name]
                    flat_bucket = tensors[f"{pre}.gbuf_idx_0.{dt}.bucket_idx_{b}.{state}"]
                    if key not in out[state]:
                        out[state][key] = torch.full(shapes[key], float("nan"),
                                                     dtype=flat_bucket.dtype)
                    to_global(flat_bucket[s:e], shape, split, tp, tp_rank, shapes[key], layer,
                              out[state][key])
    return out


def model_space(d, which):
    t = load_file(os.path.join(d, "expected.safetensors"))
    out = collections.defaultdict(dict)
    for k, v in t.items():
        for state in ("param", "fp32_param", "exp_avg", "exp_avg_sq"):
            p = f"optimizer.state.{state}."
            if k.startswith(p):
                out["param" if state == "fp32_param" else state][k[len(p):]] = v
    if which == "dp_zero":
        return dp_zero(d)
    return out


def dp_zero(d):
    """dp_zero_gather_scatter: one bytes item per DP group, a torch.save'd
    [{'buckets_coalesced': True, <gbuf_idx>: {(param_dtype, grad_dtype): {'param', 'exp_avg',
    'exp_avg_sq': flat tensor of numel_unpadded (whole buffer, buckets coalesced, padding
    removed), 'numel_unpadded': int}}}]; the buckets' end padding is removed, so parameter
    offsets are the bucket layout's with each bucket shifted by sum(previous numel_unpadded)."""
    ckpt = checkpoint_dir(os.path.join(d, "ckpt"))
    meta = read_metadata(ckpt)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    shapes = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")}
    items = bytes_items(ckpt, meta)
    case = json.load(open(os.path.join(d, "case.json")))
    tp, pp = case["tp"], case["pp"]
    out = collections.defaultdict(dict)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            idx = pp_rank * tp + tp_rank
            pre = f"optimizer.distributed.dp_group_idx_{idx}"
            st = torch.load(io.BytesIO(items[pre + ".param_state/shard_0_1"]), weights_only=False)[0]
            assert st["buckets_coalesced"] is True
            (dtypes, buf), = st[0].items()
            # the per-bucket sizes are the same as dp_reshardable's; recompute them from the
            # layout of the buffer: here one bucket (no bucket_size) -> unpadded = buffer's
            nbu = [buf["numel_unpadded"]]
            nb = [pad(buf["numel_unpadded"], 128)]
            params = model_params(shapes, tp, pp, pp_rank, "output_layer.weight" not in shapes)
            pos = layout(params, nbu, nb, False)
            for state in ("param", "exp_avg", "exp_avg_sq"):
                for name, key, layer, split, shape in params:
                    b, s, e = pos[name]
                    flat_t = buf[state]
                    if key not in out[state]:
                        out[state][key] = torch.full(shapes[key], float("nan"), dtype=flat_t.dtype)
                    to_global(flat_t[s:e], shape, split, tp, tp_rank, shapes[key], layer,
                              out[state][key])
    return out


PAIRS = [  # (dp_reshardable or dp_zero fixture, the same run in model space, layout)
    ("v0.19.2/dp2", "v0.19.2/dp2_fully_reshardable", "dp_reshardable"),
    ("v0.19.2/dp2_buckets", "v0.19.2/dp2_fully_reshardable", "dp_reshardable"),
    ("v0.19.2/dp2_dp_zero_gather_scatter", "v0.19.2/dp2_fully_reshardable", "dp_zero"),
    ("v0.19.2/mlm_tp2dp2", "v0.19.2/tp2dp2_fully_reshardable", "dp_reshardable"),
    ("v0.19.2/bridge_bf16_dp2", "v0.19.2/bf16_dp2_plain", "dp_reshardable"),
    ("v0.16.1/dp2", "v0.16.1/dp2_fully_reshardable", "dp_reshardable"),
]


def check_buckets():
    report = []
    for a, b, kind in PAIRS:
        da, db = os.path.join(HERE, a), os.path.join(HERE, b)
        if not (os.path.isdir(da) and os.path.isdir(db)):
            report.append(f"skip {a} (missing)")
            continue
        got = unflatten_dp_reshardable(da) if kind == "dp_reshardable" else dp_zero(da)
        want = model_space(db, "model")
        worst = 0.0
        for state in ("exp_avg", "exp_avg_sq", "param"):
            for key, w in want[state].items():
                g = got[state][key]
                assert not torch.isnan(g).any(), (a, state, key, "not covered")
                assert g.shape == w.shape, (a, state, key)
                diff = (g.float() - w.float()).abs().max().item()
                worst = max(worst, diff)
                assert diff <= 1e-6 * max(1.0, w.float().abs().max().item()), (a, b, state, key, diff)
        n = sum(len(v) for v in want.values())
        report.append(f"{a} == {b}: {n} tensors, max |diff| {worst:g}")
    return report


# --------------------------------------------------------------------------------------------
# 4. The model layout, by a plain-torch forward pass from the consolidated tensors
# --------------------------------------------------------------------------------------------
def reference_logits(t, cfg, tokens):
    """Llama-style forward from dcp_to_torch_save's model tensors, using FORMAT.md section 4:
    stacked layers [L, ...]; linear_qkv rows grouped per query group as [q (heads/groups *
    kv_channels) ; k (kv_channels) ; v (kv_channels)]; linear_fc1 = [gate ; up]; RMSNorm
    weights under linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight; RoPE
    (non-interleaved, rotate-half, base 10000); tied: output = word embeddings."""
    f = {k: v.float() for k, v in t.items() if not k.startswith("optimizer.")}
    m = cfg["model"]
    H, nh, ng, kv = m["hidden_size"], m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]
    hpg = nh // ng
    S = tokens.shape[1]
    eps = 1e-5

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    inv = 1.0 / (10000 ** (torch.arange(0, kv, 2, dtype=torch.float32) / kv))
    fr = torch.outer(torch.arange(S, dtype=torch.float32), inv)
    emb = torch.cat([fr, fr], -1)
    cos, sin = emb.cos(), emb.sin()

    def rope(x):  # [S, heads, kv]
        x1, x2 = x.chunk(2, -1)
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    x = f["embedding.word_embeddings.weight"][tokens[0]]  # [S, H]
    L = f["decoder.layers.self_attention.linear_qkv.weight"].shape[0]
    mask = torch.full((S, S), float("-inf")).triu(1)
    for l in range(L):
        g = lambda k: f["decoder.layers." + k][l]  # noqa: E731
        h = rms(x, g("self_attention.linear_qkv.layer_norm_weight"))
        qkv = (h @ g("self_attention.linear_qkv.weight").T).view(S, ng, (hpg + 2) * kv)
        q = qkv[..., : hpg * kv].reshape(S, nh, kv)
        k = qkv[..., hpg * kv: (hpg + 1) * kv]
        v = qkv[..., (hpg + 1) * kv:]
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(hpg, dim=1)
        v = v.repeat_interleave(hpg, dim=1)
        a = torch.einsum("shd,thd->hst", q, k) / kv ** 0.5 + mask
        o = torch.einsum("hst,thd->shd", a.softmax(-1), v).reshape(S, nh * kv)
        x = x + o @ g("self_attention.linear_proj.weight").T
        h = rms(x, g("mlp.linear_fc1.layer_norm_weight"))
        gate, up = (h @ g("mlp.linear_fc1.weight").T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ g("mlp.linear_fc2.weight").T
    x = rms(x, f["decoder.final_layernorm.weight"])
    out = f.get("output_layer.weight", f["embedding.word_embeddings.weight"])
    return (x @ out.T)[None]


def check_logits():
    report = []
    for d in fixture_dirs():
        case = json.load(open(os.path.join(d, "case.json")))
        lg = load_file(os.path.join(d, "logits.safetensors"))
        ref = reference_logits(load_file(os.path.join(d, "expected.safetensors")), case, lg["tokens"])
        diff = (ref - lg["logits"]).abs().max().item()
        tol = 5e-3 if case["bf16"] else 1e-6
        assert diff < tol, (d, diff)
        report.append(f"{os.path.relpath(d, HERE)}: logits [1, {lg['logits'].shape[1]}, "
                      f"{lg['logits'].shape[2]}] max |ref - megatron| {diff:.2g}")
    return report


def main():
    show = "--globals" in sys.argv
    check_globals(show)
    for d in fixture_dirs():
        check_expected(d)
    print("dcp_to_torch_save == expected.safetensors:", len(fixture_dirs()), "fixtures")
    for line in check_buckets():
        print(line)
    for line in check_logits():
        print(line)
    print("all checks passed")


if __name__ == "__main__":
    main()

"""Every operation of `fsdp_ckpt` against the repository's PyTorch 2.13 fixtures: the files it
writes are the ones PyTorch writes, bit for bit; bad input raises `fsdp_ckpt.Error` with the
crate's variant and writes nothing."""

import shutil
import sys
import threading

import pytest
import torch

import fsdp_ckpt
from conftest import GOLDEN, listing, load, same, state_names_sorted

FLAT = GOLDEN / "fsdp_ckpt" / "flat"
ORIG = GOLDEN / "fsdp_ckpt" / "orig"
DCP_CASES = ["fsdp2_adam_ws4", "fsdp2_adamw_ws3_tied", "fsdp2_sgd_ws2_frozen", "fsdp1_flat_ws4", "fsdp1_orig_ws3", "dtensor_grid_ws4"]


@pytest.mark.parametrize("case", [FLAT, ORIG], ids=["flat", "use_orig_params"])
def test_consolidate_torch_gives_full_optim_state_dict_of_two_fsdp1_ranks(case, tmp_path):
    out = tmp_path / "full.pt"
    report = fsdp_ckpt.consolidate_torch(case / "desc.json", [case / "rank0.pt", case / "rank1.pt"], out)
    same(load(case / "full.pt"), load(out))
    assert report["operation"] == "consolidate_torch"
    assert report["world_size"] == 2 and report["count"] == len(load(out)["state"])


@pytest.mark.parametrize("case", [FLAT, ORIG], ids=["flat", "use_orig_params"])
def test_shard_torch_gives_each_ranks_shard_full_optim_state_dict(case, tmp_path):
    out = tmp_path / "shards"
    report = fsdp_ckpt.shard_torch(case / "desc.json", case / "full.pt", 2, out)
    assert report["world_size"] == 2
    for r in range(2):
        same(state_names_sorted(load(case / f"shard{r}.pt")), state_names_sorted(load(out / f"rank{r}.pt")))


def test_consolidate_sharded_fsdp1_sharded_state_dicts(tmp_path):
    case = GOLDEN / "sharded_torch" / "fsdp1"
    out = tmp_path / "full.pt"
    fsdp_ckpt.consolidate_sharded([case / "rank0.pt", case / "rank1.pt"], out)
    same(load(case / "full.pt"), load(out))


@pytest.mark.parametrize("case", DCP_CASES)
def test_consolidate_a_pytorch_dcp_directory_equals_dcp_to_torch_save(case, tmp_path):
    out = tmp_path / "full.pt"
    report = fsdp_ckpt.dcp_to_torch_save(GOLDEN / "dcp" / case / "ckpt", out)
    same(load(GOLDEN / "dcp" / case / "expected.pt"), load(out))
    assert report["tensor_bytes"] > 0


SOURCE_CASES = [
    "per_rank_ws2",
    "per_rank_ws3",
    "hf_rank0",
    "hf_rank0_mapped",
    "hf_distributed",
    "hf_distributed_mapped",
    "hf_consolidated",
]


@pytest.mark.parametrize("case", SOURCE_CASES)
def test_every_dcp_form_consolidates_to_what_pytorch_holds(case, tmp_path):
    # Per-rank metadata: the saving run's full get_state_dict (not dcp_to_torch_save's
    # result); Hugging Face storage: HuggingFaceStorageReader's load.
    ckpt = GOLDEN / "dcp_sources" / case / "ckpt"
    out = tmp_path / "full.pt"
    fsdp_ckpt.consolidate(ckpt, out)
    same(load(GOLDEN / "dcp_sources" / case / "expected.pt"), load(out))
    assert fsdp_ckpt.inspect(ckpt)["format"] == "dcp"
    assert fsdp_ckpt.verify(ckpt)["format"] == "dcp"


def test_inspect_and_verify_a_dcp_directory():
    ckpt = GOLDEN / "dcp" / "fsdp2_adam_ws4" / "ckpt"
    found = fsdp_ckpt.inspect(ckpt)
    assert found["format"] == "dcp" and found["world_size"] == 4
    keys = [e["key"] for e in found["entries"]]
    assert "optim.state.embed.weight.exp_avg" in keys
    checked = fsdp_ckpt.verify(ckpt)
    assert checked["format"] == "dcp" and checked["tensors"] > 0 and checked["chunks"] >= checked["tensors"]


def test_inspect_a_torch_save_file_reads_its_structure():
    found = fsdp_ckpt.inspect(FLAT / "full.pt")
    assert found["format"] == "torch.save" and found["kind"] == "optimizer"
    assert found["tensor_count"] == sum(
        isinstance(v, torch.Tensor) for st in load(FLAT / "full.pt")["state"].values() for v in st.values()
    )


def test_convert_round_trips_through_safetensors_and_dcp(tmp_path):
    st = tmp_path / "full.safetensors"
    fsdp_ckpt.convert(FLAT / "full.pt", st)
    back = tmp_path / "back.pt"
    fsdp_ckpt.convert(st, back)
    same(load(FLAT / "full.pt"), load(back))
    dcp = tmp_path / "dcp"
    fsdp_ckpt.torch_save_to_dcp(FLAT / "full.pt", dcp)
    assert fsdp_ckpt.verify(dcp)["format"] == "dcp"
    again = tmp_path / "again.pt"
    fsdp_ckpt.consolidate(dcp, again)
    same(load(FLAT / "full.pt"), load(again))


def test_dcp_to_the_crates_checkpoint_reshard_and_consolidate(tmp_path):
    # tests/golden/dcp/gen.py's Net wrapped as FSDP1 wraps it (net1, net2, the root).
    params = [("embed.weight", [10, 4]), ("net1.0.weight", [10, 4]), ("net1.0.bias", [10]), ("net2.0.weight", [3, 10]), ("net2.0.bias", [3]), ("head.weight", [10, 3]), ("out.weight", [10, 4])]
    desc = tmp_path / "desc.json"
    import json

    desc.write_text(json.dumps({"model": {"params": [{"name": n, "shape": s, "dtype": "f32"} for n, s in params]}, "policy": {"units": ["net1", "net2", ""]}}))
    ckpt = tmp_path / "ckpt3"
    report = fsdp_ckpt.convert(GOLDEN / "dcp" / "fsdp2_adam_ws4" / "ckpt", ckpt, to="fsdp", model=desc, world_size=3)
    assert report["world_size"] == 3
    assert fsdp_ckpt.inspect(ckpt)["world_size"] == 3
    assert fsdp_ckpt.verify(ckpt)["format"] == "checkpoint"
    ckpt2 = tmp_path / "ckpt2"
    fsdp_ckpt.reshard(ckpt, ckpt2, 2)
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fsdp_ckpt.consolidate(ckpt, a)
    fsdp_ckpt.consolidate(ckpt2, b)
    same(load(a), load(b))
    # The same state PyTorch saved (in the crate's FSDP1 unit order, which is not FSDP2's).
    expected = load(GOLDEN / "dcp" / "fsdp2_adam_ws4" / "expected.pt")["optim"]["state"]
    got = load(a)["state"]
    assert sorted(got) == sorted(expected)
    for k in expected:
        same(state_names_sorted({"state": {k: expected[k]}}), state_names_sorted({"state": {k: got[k]}}))


def test_progress_reports_each_phase_with_its_size(tmp_path):
    calls = []
    fsdp_ckpt.consolidate_torch(FLAT / "desc.json", [FLAT / "rank0.pt", FLAT / "rank1.pt"], tmp_path / "full.pt", progress=lambda *a: calls.append(a))
    assert ("reading rank files", 0, 2) in calls and ("reading rank files", 2, 2) in calls
    assert any(phase.startswith("writing") for phase, _, _ in calls)
    byte_calls = []
    fsdp_ckpt.consolidate(GOLDEN / "dcp" / "fsdp2_adam_ws4" / "ckpt", tmp_path / "d.pt", progress=lambda *a: byte_calls.append(a))
    phase, done, total = byte_calls[-1]
    assert phase == "consolidating" and done == total and total > 0


def test_a_failing_progress_callback_is_reported_and_does_not_stop_the_operation(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))

    def broken(*_):
        raise KeyError("callback bug")

    fsdp_ckpt.consolidate_torch(FLAT / "desc.json", [FLAT / "rank0.pt", FLAT / "rank1.pt"], tmp_path / "full.pt", progress=broken)
    same(load(FLAT / "full.pt"), load(tmp_path / "full.pt"))
    assert seen and isinstance(seen[0], KeyError)


def test_long_operations_release_the_gil(tmp_path):
    # 64 MiB of state: long enough for a Python thread to run while it is consolidated.
    big = {"state": {i: {"exp_avg": torch.randn(2 << 20)} for i in range(8)}, "param_groups": [{"lr": 0.1, "params": list(range(8))}]}
    torch.save(big, tmp_path / "big.pt")
    fsdp_ckpt.torch_save_to_dcp(tmp_path / "big.pt", tmp_path / "dcp")
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        before = ticks[0]
        fsdp_ckpt.consolidate(tmp_path / "dcp", tmp_path / "back.pt")
        during = ticks[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 0, "no Python thread ran while the operation worked: the GIL was held"
    # DCP keys are strings (PyTorch's dcp_to_torch_save gives the same).
    back = load(tmp_path / "back.pt")
    for i in range(8):
        same(big["state"][i], back["state"][str(i)])


def test_a_missing_input_raises_io_not_found_and_writes_nothing(tmp_path):
    with pytest.raises(fsdp_ckpt.Error) as e:
        fsdp_ckpt.convert(tmp_path / "missing.pt", tmp_path / "out.safetensors")
    assert e.value.kind == "Io" and e.value.io_kind == "NotFound"
    assert "missing.pt" in str(e.value)
    assert listing(tmp_path) == []


def test_rank_files_of_another_world_size_raise_world_size_mismatch_and_write_nothing(tmp_path):
    with pytest.raises(fsdp_ckpt.Error) as e:
        fsdp_ckpt.consolidate_torch(FLAT / "desc.json", [FLAT / "rank0.pt"], tmp_path / "full.pt")
    assert e.value.kind == "WorldSizeMismatch", repr(e.value)
    assert e.value.detail["files"] == 1
    assert listing(tmp_path) == []


def test_a_hostile_dcp_directory_raises_a_typed_error_naming_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / "dcp" / "fsdp2_sgd_ws2_frozen" / "ckpt", ckpt)
    shutil.copy(GOLDEN / "dcp" / "hostile" / "exploit.metadata", ckpt / ".metadata")
    with pytest.raises(fsdp_ckpt.Error) as e:
        fsdp_ckpt.consolidate(ckpt, tmp_path / "out.pt")
    # The pickle tries to call os.system: refused before anything runs.
    assert e.value.kind == "UnsupportedPickleGlobal", repr(e.value)
    assert "system" in str(e.value) and ".metadata" in str(e.value)
    assert not (tmp_path / "out.pt").exists()


def test_an_output_holding_other_files_is_refused_and_kept(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(fsdp_ckpt.Error):
        fsdp_ckpt.shard_torch(FLAT / "desc.json", FLAT / "full.pt", 2, out)
    assert listing(tmp_path) == ["shards", "shards/notes.txt"]


def test_a_single_path_where_rank_files_are_expected_is_a_type_error(tmp_path):
    with pytest.raises(TypeError):
        fsdp_ckpt.consolidate_sharded(FLAT / "rank0.pt", tmp_path / "out.pt")


TORCH_LOAD = GOLDEN / "torch_load"


def torch_load_describe():
    """`describe` of tests/golden/torch_load/check.py: what torch.load(weights_only=True) reads,
    Parameters, attributes, sparse indices and quantization parameters included."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_load_check", TORCH_LOAD / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.describe


@pytest.mark.parametrize(
    "name",
    ["fsdp1_full_state_dict", "parameter_with_state", "sparse_coo", "sparse_bsr", "quantized_per_channel", "meta", "values", "legacy_format"],
)
def test_every_kind_weights_only_reads_converts_to_an_equal_pt(name, tmp_path):
    describe = torch_load_describe()
    out = tmp_path / "out.pt"
    fsdp_ckpt.convert(TORCH_LOAD / f"{name}.pt", out)
    original = torch.load(TORCH_LOAD / f"{name}.pt", weights_only=True)
    assert describe(torch.load(out, weights_only=True)) == describe(original)


def test_inspect_names_sparse_and_quantized_tensors():
    found = fsdp_ckpt.inspect(TORCH_LOAD / "quantized_per_tensor.pt")
    layouts = {t["name"]: t.get("layout") for t in found["tensors"]}
    assert layouts == {n: f"quantized tensor (torch.{n})" for n in ["qint8", "quint8", "qint32"]}
    coo = fsdp_ckpt.inspect(TORCH_LOAD / "sparse_coo.pt")["tensors"]
    assert [(t["name"], t["shape"], t["layout"]) for t in coo] == [("s", [2, 3], "sparse COO tensor")]


def test_an_fsdp1_full_state_dict_goes_to_dcp_by_its_values_and_sparse_is_refused_by_name(tmp_path):
    dcp = tmp_path / "dcp"
    fsdp_ckpt.torch_save_to_dcp(TORCH_LOAD / "fsdp1_full_state_dict.pt", dcp)
    back = tmp_path / "back.pt"
    fsdp_ckpt.consolidate(dcp, back)
    original = torch.load(TORCH_LOAD / "fsdp1_full_state_dict.pt", weights_only=True)
    same(dict((k, v.detach().clone()) for k, v in original.items()), load(back))
    with pytest.raises(fsdp_ckpt.Error) as e:
        fsdp_ckpt.convert(TORCH_LOAD / "sparse_coo.pt", tmp_path / "s.safetensors")
    assert e.value.kind == "TensorNotStorable" and "sparse COO" in str(e.value)
    assert not (tmp_path / "s.safetensors").exists()


def test_convert_to_hf_and_back_as_save_pretrained_and_fsdp_expect(tmp_path):
    # tests/golden/hf: an FSDP2 DCP checkpoint of a tiny Llama and save_pretrained's files.
    hf = GOLDEN / "hf" / "llama_tied"
    out = tmp_path / "hf"
    report = fsdp_ckpt.convert(
        hf / "dcp", out, to="hf", max_shard_size="60KB", dtype="bf16", config=hf / "hf_60KB" / "config.json"
    )
    assert report["count"] == 20
    reference = hf / "hf_60KB_bf16"
    names = sorted(p.name for p in reference.glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == names
    for n in names + ["model.safetensors.index.json"]:
        assert (out / n).read_bytes() == (reference / n).read_bytes(), n
    # A rename mapping, in order: the names change, the tensors do not.
    renamed = tmp_path / "renamed"
    fsdp_ckpt.convert(hf / "dcp", renamed, to="hf", config=hf / "hf_60KB" / "config.json", rename={r"\.mlp\.": ".ffn.", r"\.ffn\.up_(\w+)": r".ffn.w3_\1"})
    from safetensors.torch import load_file

    got = load_file(renamed / "model.safetensors")
    want = load_file(hf / "hf_default" / "model.safetensors")
    assert torch.equal(got["model.layers.1.ffn.w3_proj.weight"], want["model.layers.1.mlp.up_proj.weight"])
    assert "lm_head.weight" not in got
    # Import: the directory becomes DCP under `model.`, the tied head restored.
    dcp = tmp_path / "dcp"
    fsdp_ckpt.convert(hf / "hf_60KB", dcp, to="dcp", config=hf / "hf_60KB" / "config.json")
    keys = {e["key"] for e in fsdp_ckpt.inspect(dcp)["entries"]}
    assert {"model.lm_head.weight", "model.model.embed_tokens.weight"} <= keys
    with pytest.raises(fsdp_ckpt.Error, match="would both be named"):
        fsdp_ckpt.convert(hf / "dcp", tmp_path / "bad", to="hf", rename=[("(q|k)_proj", "qk")])
    assert not (tmp_path / "bad").exists()


def test_convert_to_hf_ties_each_architectures_own_embedding(tmp_path):
    # tests/golden/hf/tied (gen_ties.py): issue 40's FSDP2 GPT-2 (AdamW, world 2) and
    # save_pretrained of the same weights, which leaves out lm_head.weight (= transformer.wte.weight).
    gpt2 = GOLDEN / "hf" / "tied" / "gpt2"
    config = gpt2 / "hf" / "config.json"
    out = tmp_path / "hf"
    report = fsdp_ckpt.convert(gpt2 / "dcp", out, to="hf", config=config)
    assert (out / "model.safetensors").read_bytes() == (gpt2 / "hf" / "model.safetensors").read_bytes()
    assert report["count"] == 28
    # Back to DCP: the head restored as the copy get_state_dict holds.
    dcp = tmp_path / "dcp"
    fsdp_ckpt.convert(gpt2 / "hf", dcp, to="dcp", config=config)
    keys = {e["key"] for e in fsdp_ckpt.inspect(dcp)["entries"]}
    assert {"model.lm_head.weight", "model.transformer.wte.weight"} <= keys
    # An architecture outside the table that ties is refused, naming the option to use.
    other = tmp_path / "config.json"
    other.write_text(config.read_text().replace("GPT2LMHeadModel", "MyGPT"))
    with pytest.raises(fsdp_ckpt.Error, match="--tie") as e:
        fsdp_ckpt.convert(gpt2 / "dcp", tmp_path / "bad", to="hf", config=other)
    assert e.value.kind == "HfTieArchitecture" and "MyGPT" in str(e.value)
    assert not (tmp_path / "bad").exists()
    fsdp_ckpt.convert(gpt2 / "dcp", tmp_path / "named", to="hf", config=other, tie={"lm_head.weight": "transformer.wte.weight"})
    assert (tmp_path / "named" / "model.safetensors").read_bytes() == (gpt2 / "hf" / "model.safetensors").read_bytes()

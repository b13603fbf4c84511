"""DeepSpeed checkpoints from Python, without DeepSpeed (`tests/golden/deepspeed/`, written by
DeepSpeed 0.19.8 and PyTorch 2.13 by `gen.py` beside them): `inspect`, `consolidate` equal to
DeepSpeed's own `zero_to_fp32`, `consolidate(optim=True)` equal to its universal checkpoint,
and `convert(to="dcp")` holding what PyTorch's own `dcp_to_torch_save` reads back as that
consolidated dict. (FSDP2 loading the DCP directory at 1 and 3 ranks and training on is
tests/it/deepspeed.rs's, through `fsdp2_continue.py`.)"""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsdp_ckpt
from conftest import GOLDEN, load, same

DS = GOLDEN / "deepspeed"
CASES = ["zero1_fp32", "zero1_bf16", "zero2_fp32", "zero2_bf16", "zero3_fp32", "zero3_bf16", "zero1_bf16_fp32acc"]
# Issue 40: a frozen embedding (requires_grad=False), AdamW, every stage and dtype at 2 and 3 ranks.
FROZEN_CASES = ["frozen_zero1_fp32_ws2", "frozen_zero1_bf16_ws3", "frozen_zero2_fp32_ws3", "frozen_zero2_bf16_ws2",
                "frozen_zero3_fp32_ws2", "frozen_zero3_bf16_ws3"]


def case_json(case):
    return json.loads((DS / case / "case.json").read_text())


def ucp_state(case, name, state):
    t = load(DS / case / "ucp" / "step3" / "zero" / name / f"{state}.pt")
    if isinstance(t, dict):  # stages 1 and 2: {'cat_dim': 0, 'param': t}
        t = t["param"]
    return t.reshape(case_json(case)["param_shapes"][name])


@pytest.mark.parametrize("case", CASES + FROZEN_CASES)
def test_inspect_gives_stage_dtype_world_size_tag_and_parameters(case):
    info = case_json(case)
    found = fsdp_ckpt.inspect(DS / case / "ckpt")
    assert found["format"] == "deepspeed"
    assert (found["stage"], found["world_size"], found["tag"]) == (info["stage"], info["world_size"], "step3")
    assert [(f["name"], f["shape"]) for f in found["frozen"]] == list(info.get("frozen", {}).items())
    assert found["dtype"] == {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[info["dtype"]]
    assert [p["name"] for p in found["params"]] == [
        n for g in info["param_groups"] for n in g["members"]
    ]
    assert all(p["step"] == info["steps"] for p in found["params"])


@pytest.mark.parametrize("case", CASES + FROZEN_CASES)
def test_consolidate_equals_zero_to_fp32(case, tmp_path):
    out = tmp_path / "fp32.safetensors"
    report = fsdp_ckpt.consolidate(DS / case / "ckpt", out)
    assert report["tensor_bytes"] > 0
    got, want = load_file(out), load_file(DS / case / "expected_fp32.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        same(want[k], got[k], k)


@pytest.mark.parametrize("case", ["zero1_bf16", "zero2_fp32", "zero3_bf16"])
def test_consolidate_optim_holds_the_universal_checkpoints_adam_state(case, tmp_path):
    out = tmp_path / "full.pt"
    fsdp_ckpt.consolidate(DS / case / "ckpt", out, optim=True)
    full = load(out)
    assert list(full) == ["model", "optim"]
    info = case_json(case)
    for name in info["param_names"]:
        st = full["optim"]["state"][name]
        assert list(st) == ["step", "exp_avg", "exp_avg_sq"]
        assert float(st["step"]) == info["steps"]
        for s in ("exp_avg", "exp_avg_sq"):
            same(ucp_state(case, name, s), st[s], f"{name}.{s}")
    groups = full["optim"]["param_groups"]
    assert [g["params"] for g in groups] == [g["members"] for g in info["param_groups"]]


@pytest.mark.parametrize("case", ["frozen_zero1_bf16_ws3", "frozen_zero3_fp32_ws2"])
def test_frozen_parameters_are_float32_weights_without_optimizer_state(case, tmp_path):
    out = tmp_path / "full.pt"
    fsdp_ckpt.consolidate(DS / case / "ckpt", out, optim=True)
    full = load(out)
    want = load_file(DS / case / "expected_fp32.safetensors")
    for name in ("emb.weight", "head_lm.weight"):
        same(want[name].float(), full["model"][name], name)
    assert "emb.weight" not in full["optim"]["state"]
    assert all("emb.weight" not in g["params"] for g in full["optim"]["param_groups"])
    # And as DCP: PyTorch reads back the same dict.
    dcp = tmp_path / "dcp"
    fsdp_ckpt.convert(DS / case / "ucp", dcp, to="dcp")
    back = tmp_path / "back.pt"
    dcp_to_torch_save(dcp, back)
    same(full, load(back))


def test_optim_is_refused_for_other_inputs(tmp_path):
    out = tmp_path / "o.pt"
    with pytest.raises(fsdp_ckpt.Error, match="consolidate --optim takes a DeepSpeed checkpoint"):
        fsdp_ckpt.consolidate(GOLDEN / "dcp" / "fsdp2_adam_ws4" / "ckpt", out, optim=True)
    assert not out.exists()


@pytest.mark.parametrize("case,source", [("zero2_bf16", "ckpt"), ("zero3_fp32", "ucp")])
def test_convert_to_dcp_reads_back_in_pytorch_as_the_consolidated_state(case, source, tmp_path):
    dcp = tmp_path / "dcp"
    fsdp_ckpt.convert(DS / case / source, dcp, to="dcp")
    assert fsdp_ckpt.inspect(dcp)["format"] == "dcp"
    full = tmp_path / "full.pt"
    fsdp_ckpt.consolidate(DS / case / source, full, optim=True)
    back = tmp_path / "back.pt"
    dcp_to_torch_save(dcp, back)
    same(load(full), load(back))


def test_a_latest_naming_a_missing_tag_raises_a_typed_error(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "latest").write_text("step9")
    with pytest.raises(fsdp_ckpt.Error) as e:
        fsdp_ckpt.consolidate(root, tmp_path / "o.pt")
    assert "step9" in str(e.value)
    assert not (tmp_path / "o.pt").exists()

"""`fsdp_ckpt.describe` / `write_desc` on live models in real PyTorch 2.13 (CPU, gloo): for every
model and wrapping the golden generators use, the description equals the one the generator
wrote, and fed to `consolidate_torch` it gives `FSDP.full_optim_state_dict`'s output bit for
bit."""

import json
import socket
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import _describe_ranks
import fsdp_ckpt
from conftest import GOLDEN, load, same

sys.path.insert(0, str(GOLDEN))  # the generator's SCENARIOS table
_gen = _describe_ranks.golden_module("gen.py", "golden_fsdp1_gen")

CASES = [(name, None) for name in _gen.SCENARIOS] + [
    (name, load_name) for name, cfg in _gen.SCENARIOS.items() for load_name in cfg.get("loads", {})
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, ws, *args, outputs):
    """Runs `fn(rank, ws, port, *args)` on `ws` ranks. gloo sometimes aborts a process at exit
    after all work is done: a run whose outputs are complete counts, others are retried."""
    for _ in range(3):
        try:
            mp.spawn(fn, args=(ws, free_port(), *args), nprocs=ws, join=True)
        except Exception as e:
            print(f"spawn raised {e!r}", file=sys.stderr)
        if all(Path(o).exists() for o in outputs):
            return
    raise AssertionError(f"{fn.__name__}: no complete result after 3 attempts")


@pytest.mark.parametrize("scenario,load_name", CASES, ids=[f"{s}-{l}" if l else s for s, l in CASES])
def test_write_desc_reproduces_the_golden_description(scenario, load_name, tmp_path):
    cfg = _gen.SCENARIOS[scenario]
    ws = cfg["loads"][load_name]["ws"] if load_name else cfg["ws"]
    out = tmp_path / "desc.json"
    spawn(_describe_ranks.fsdp1, ws, scenario, load_name, str(out), outputs=[out])
    written = json.loads(out.read_text())
    golden = json.loads((GOLDEN / "fsdp" / scenario / "desc.json").read_text())
    assert written["model"] == golden["model"]
    want_policy = golden["loads"][load_name]["policy"] if load_name else golden["policy"]
    assert written["policy"] == want_policy
    rank_dir = GOLDEN / "fsdp" / scenario / (f"load_{load_name}" if load_name else "")
    for r in range(ws):
        assert written["optim_params_per_rank"][r] == json.loads(load(rank_dir / f"rank{r}.pt")["optim_params"]), f"rank {r}"
    # `fsdp-ckpt consolidate-torch` with the written description gives PyTorch's full dict.
    if load_name is None and cfg.get("strategy") != "HYBRID_SHARD":  # hybrid: not offline
        ranks = [tmp_path / f"rank{r}.pt" for r in range(ws)]
        for r, f in enumerate(ranks):
            torch.save(load(rank_dir / f"rank{r}.pt")["local"][-1], f)
        fsdp_ckpt.consolidate_torch(out, ranks, tmp_path / "full.pt")
        if cfg.get("use_orig_params"):
            # PyTorch's CPU `full_optim_state_dict` aliases every gathered state to one buffer
            # with use_orig_params (tests/it/golden_fsdp.rs checks the crate against the GPU-correct
            # result): here the golden description must give the same file.
            by_golden = tmp_path / "golden_desc.json"
            per_rank = [json.loads(load(rank_dir / f"rank{r}.pt")["optim_params"]) for r in range(ws)]
            by_golden.write_text(json.dumps({"model": golden["model"], "policy": golden["policy"], "optim_params_per_rank": per_rank}))
            fsdp_ckpt.consolidate_torch(by_golden, ranks, tmp_path / "reference.pt")
            same(load(tmp_path / "reference.pt"), load(tmp_path / "full.pt"))
        else:
            same(load(rank_dir / "rank0.pt")["full"], load(tmp_path / "full.pt"))


@pytest.mark.parametrize("case,use_orig", [("flat", False), ("orig", True)])
def test_write_desc_of_the_cli_fixtures_model_consolidates_to_pytorchs_full_dict(case, use_orig, tmp_path):
    fixture = GOLDEN / "fsdp_ckpt" / case
    out = tmp_path / "desc.json"
    spawn(_describe_ranks.fsdp_ckpt_model, 2, use_orig, str(out), outputs=[out])
    written = json.loads(out.read_text())
    # The generator's hand-written description leaves the defaults out.
    golden = json.loads((fixture / "desc.json").read_text())
    for p in golden["model"]["params"]:
        p.setdefault("requires_grad", True)
    golden["model"].setdefault("tied", {})
    golden["policy"] = {"ignored_modules": [], "sharding_strategy": "FULL_SHARD", **golden["policy"]}
    assert written["model"] == golden["model"] and written["policy"] == golden["policy"]
    # Offloading disabled in the generator, so PyTorch's full dict is right for both.
    full = tmp_path / "full.pt"
    fsdp_ckpt.consolidate_torch(out, [fixture / "rank0.pt", fixture / "rank1.pt"], full)
    same(load(fixture / "full.pt"), load(full))


def test_write_desc_of_an_fsdp2_model_matches_the_fully_shard_golden(tmp_path):
    layout = json.loads((GOLDEN / "fsdp2" / "layout.json").read_text())
    out = tmp_path / "desc.json"
    spawn(_describe_ranks.fsdp2, 2, str(out), outputs=[out])
    written = json.loads(out.read_text())
    assert written["model"] == layout["model"]
    assert written["policy"] == {"units": layout["units"], "fsdp_version": 2, "ignored_modules": layout["ignored_modules"]}
    trained = [{"Param": p["name"]} for p in layout["model"]["params"] if p["requires_grad"]]
    assert written["optim_params_per_rank"] == [{"groups": [trained], "named": False}] * 2


@pytest.mark.parametrize("name", ["adam_amsgrad", "adamw", "sgd"])
@pytest.mark.parametrize("ws", [2, 3])
def test_write_desc_of_fsdp2_ranks_consolidates_their_files_to_get_optimizer_state_dict(name, ws, tmp_path):
    case = GOLDEN / "fsdp2" / "optim" / name
    out = tmp_path / "desc.json"
    spawn(_describe_ranks.fsdp2_optim, ws, name, str(out), outputs=[out])
    written = json.loads(out.read_text())
    golden = json.loads((case / "desc.json").read_text())
    assert written["model"] == golden["model"]
    assert written["policy"] == {"ignored_modules": [], **golden["policy"]}
    everything = {"groups": [[{"Param": p["name"]} for p in golden["model"]["params"]]], "named": False}
    assert written["optim_params_per_rank"] == [golden.get("optim_params", everything)] * ws
    # The rank files PyTorch saved (to_local() shards), consolidated with the written
    # description: get_optimizer_state_dict(full_state_dict=True), bit for bit.
    full = tmp_path / "full.pt"
    fsdp_ckpt.consolidate_torch(out, [case / f"ws{ws}" / f"rank{r}.pt" for r in range(ws)], full)
    same(load(case / f"ws{ws}" / "full.pt"), load(full))


def test_an_optimizer_tensor_outside_the_model_fails_every_rank_and_writes_nothing(tmp_path):
    out = tmp_path / "desc.json"
    outcomes = [Path(f"{out}.rank{r}") for r in range(2)]
    spawn(_describe_ranks.not_a_parameter, 2, str(out), outputs=outcomes)
    seen = [o.read_text() for o in outcomes]
    assert seen[1].startswith("ValueError") and "not a parameter of the model" in seen[1]
    assert seen[0].startswith("RuntimeError") and "rank 1" in seen[0]
    assert not out.exists()


def test_describe_refuses_a_model_without_fsdp():
    import torch

    with pytest.raises(ValueError, match="no FSDP units"):
        fsdp_ckpt.describe(torch.nn.Linear(2, 2))

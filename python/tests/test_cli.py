"""The `fsdp-ckpt` command the package installs next to the interpreter: the Rust tool's
command line (same arguments, output and exit codes), run from the package."""

import os
import subprocess
import sys
from pathlib import Path

import fsdp_ckpt
from conftest import GOLDEN, listing, load, same

FLAT = GOLDEN / "fsdp_ckpt" / "flat"
EXE = Path(sys.executable).parent / "fsdp-ckpt"


def run(*args):
    return subprocess.run([str(EXE), "--quiet", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_the_command_is_the_packages_entry_point():
    assert EXE.is_file() and os.access(EXE, os.X_OK)
    assert "fsdp_ckpt._cli" in EXE.read_text(errors="replace")
    out = subprocess.run([str(EXE), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"fsdp-ckpt {fsdp_ckpt.__version__}"


def test_consolidate_torch_from_the_command_line(tmp_path):
    out = tmp_path / "full.pt"
    done = run("consolidate-torch", "--model", FLAT / "desc.json", FLAT / "rank0.pt", FLAT / "rank1.pt", "-o", out)
    assert done.returncode == 0, done.stderr
    assert "consolidated 2 ranks" in done.stderr
    same(load(FLAT / "full.pt"), load(out))


def test_inspect_json_from_the_command_line():
    import json

    done = run("inspect", "--json", GOLDEN / "dcp" / "fsdp2_adam_ws4" / "ckpt")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == fsdp_ckpt.inspect(GOLDEN / "dcp" / "fsdp2_adam_ws4" / "ckpt")


def test_errors_exit_1_with_the_crates_message_and_write_nothing(tmp_path):
    done = run("consolidate-torch", "--model", FLAT / "desc.json", FLAT / "rank0.pt", "-o", tmp_path / "full.pt")
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "world size" in done.stderr
    assert listing(tmp_path) == []


def test_usage_errors_exit_2():
    done = run("consolidate-torch")
    assert done.returncode == 2 and "Usage" in done.stderr

"""Check that a DCP checkpoint loads into an FSDP2-wrapped `LlamaForCausalLM` and gives exactly the
reference logits. Used live by the Rust tests of `fsdp-ckpt convert HF_DIR OUT --to dcp`.

    .venv/bin/python tests/golden/hf/load_check.py CONFIG_JSON DCP_DIR REFERENCE_LOGITS_PT WORLD_SIZE

* CONFIG_JSON — a `config.json` as `save_pretrained` writes it (e.g.
  `tests/golden/hf/llama_tied/hf_60KB/config.json`); the model is built from it with
  `LlamaForCausalLM(LlamaConfig.from_json_file(...))` and kept in float32 whatever its `dtype`.
* DCP_DIR — a DCP directory whose `model.`-prefixed entries are the model's state dict.
* REFERENCE_LOGITS_PT — a `logits.pt` of `gen.py`: `{"input_ids": ..., "logits": ...}`.
* WORLD_SIZE — how many gloo ranks (127.0.0.1, a free port) to spawn with
  `torch.multiprocessing`.

Every rank wraps the model with FSDP2 `fully_shard` (`init_device_mesh("cpu", (ws,))`, each
decoder layer, then the root), loads `dcp.load({"model": msd}, checkpoint_id=DCP_DIR)` with
`msd = get_model_state_dict(model)`, applies it with `set_model_state_dict(model, msd)` and
computes the logits (eval, no grad, 1 thread) on the reference `input_ids`.

Prints one line and exits 0 if the logits are exactly equal (`torch.equal`) to the reference,
1 if they differ (the line gives the max absolute difference), 2 if the checkpoint could not be
loaded at all (missing key, wrong shape, ...) or the ranks failed.
"""

import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def wrap(model, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(rank, ws, port, config_json, dcp_dir, ref_pt, result):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        torch.manual_seed(0)
        config = LlamaConfig.from_json_file(config_json)
        model = wrap(LlamaForCausalLM(config).to(torch.float32), ws)
        msd = get_model_state_dict(model)
        dcp.load({"model": msd}, checkpoint_id=dcp_dir)
        set_model_state_dict(model, msd)
        ref = torch.load(ref_pt, weights_only=True)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ref["input_ids"]).logits.float()
        if rank == 0:
            want = ref["logits"]
            if logits.shape != want.shape:
                out = {"equal": False, "msg": f"logits shape {list(logits.shape)} != "
                       f"reference {list(want.shape)}"}
            elif torch.equal(logits, want):
                out = {"equal": True, "msg": f"logits {list(want.shape)} exactly equal to the "
                       f"reference ({len(msd)} model keys loaded)"}
            else:
                diff = (logits - want).abs()
                out = {"equal": False, "msg": f"logits differ from the reference: max |diff| "
                       f"{diff.max().item():.6g}, {int((diff != 0).sum())} of {diff.numel()} "
                       f"elements differ"}
            Path(result).write_text(json.dumps(out))
        dist.barrier()
    except BaseException as e:  # dcp's CheckpointException derives from BaseException
        if rank == 0:
            msg = f"{type(e).__name__}: {e}"
            failures = getattr(e, "failures", None)  # CheckpointException: rank -> exception
            if failures:
                r, f = sorted(failures.items())[0]
                if isinstance(f, tuple):  # (exception, traceback frames)
                    f = f[0]
                msg = f"rank {r}: {type(f).__name__}: {f}"
            msg = msg.replace("\n", " ")
            Path(result).write_text(json.dumps({"error": msg[:2000]}))
        traceback.print_exc()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if len(sys.argv) != 5:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    config_json, dcp_dir, ref_pt, ws = sys.argv[1:]
    ws = int(ws)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        try:
            mp.spawn(
                worker,
                args=(ws, free_port(), config_json, dcp_dir, ref_pt, str(result)),
                nprocs=ws,
                join=True,
            )
        except Exception as e:  # gloo sometimes aborts a process at exit after the work
            print(f"load_check: spawn raised {type(e).__name__}", file=sys.stderr)
        if not result.exists():
            print(f"load_check: ERROR ws={ws}: the ranks produced no result")
            sys.exit(2)
        out = json.loads(result.read_text())
    if "error" in out:
        print(f"load_check: ERROR ws={ws}: {out['error']}")
        sys.exit(2)
    print(f"load_check: {'OK' if out['equal'] else 'MISMATCH'} ws={ws}: {out['msg']}")
    sys.exit(0 if out["equal"] else 1)


if __name__ == "__main__":
    main()

"""Tied word embeddings beyond Llama's names, from REAL PyTorch 2.13 + transformers 5.24.0: an FSDP2
training checkpoint and `save_pretrained`'s directory of a tiny model of each architecture in
`src/io/hf/tied_embeddings.txt` (the table `fsdp-ckpt convert … --to hf --config` and
`--to dcp --config` tie by), for issue 40.

Run manually from the crate root with the project's venv, and commit the output:

    .venv/bin/python tests/golden/hf/gen_ties.py              # every architecture
    .venv/bin/python tests/golden/hf/gen_ties.py gpt2 opt     # some

Nothing is downloaded. First, every row of the table is checked against transformers: the
class named by `architectures` ties `output` to `input` (`_tied_weights_keys`), and its config
class's `tie_word_embeddings` default is the row's last column. Then, for each architecture
below but Llama (whose tied fixture is `gen.py`'s `llama_tied`), a tiny model is built from its
config (`tie_word_embeddings=True`; hidden 16, vocab 64, 1-2 layers) after
`torch.manual_seed(0)`, and `tests/golden/hf/tied/<name>/` gets:

* `dcp/` — the scenario of issue 40: 2 gloo ranks (`torch.multiprocessing`, 127.0.0.1),
  FSDP2 `fully_shard` of the root (`init_device_mesh("cpu", (2,))`), one AdamW step on a fixed
  random batch, then `dcp.save({"model": msd, "optim": osd}, checkpoint_id="dcp")` of
  `get_state_dict(model, optim)` (`{"model": msd}` alone but for `gpt2`, to keep the
  fixtures small). Its `model.` entries hold the output embedding as its own
  copy next to the input embedding (asserted), as they do for Llama.
* `hf/` — `save_pretrained(hf)` of a plain model of the same config into which the saving
  run's full state dict was loaded: `config.json`, `generation_config.json`,
  `model.safetensors`. Asserted: it holds every state-dict key but the output embedding, and
  its config says `tie_word_embeddings: true` and names the architecture.

`gpt2` is issue 40's own report (GPT2LMHeadModel, 2 layers); the others have 1 layer.
"""

import json
import os
import shutil
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gen import free_port, read_dcp, same_tensors, st_names  # noqa: E402

ROOT = HERE / "tied"
TABLE = HERE.parents[2] / "src" / "io" / "hf" / "tied_embeddings.txt"
WS = 2


def table():
    rows = {}
    for line in TABLE.read_text().splitlines():
        line = line.split("#", 1)[0].split()
        if line:
            arch, output, inp, default = line
            rows[arch] = (output, inp, {"true": True, "false": False}[default])
    return rows


def config_of(name):
    import transformers as t

    small = dict(vocab_size=64, tie_word_embeddings=True)
    if name == "gpt2":
        return t.GPT2Config(n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0, **small)
    if name == "opt":
        return t.OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                           max_position_embeddings=32, word_embed_proj_dim=16, **small)
    if name == "bloom":
        return t.BloomConfig(hidden_size=16, n_layer=1, n_head=2, **small)
    if name == "falcon":
        return t.FalconConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              max_position_embeddings=32, **small)
    if name == "gpt_neox":
        return t.GPTNeoXConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=32, **small)
    if name == "gemma":
        return t.GemmaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             max_position_embeddings=32, **small)
    if name == "qwen2":
        return t.Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=32, **small)
    raise SystemExit(f"unknown architecture {name!r}; known: {', '.join(NAMES)}")


NAMES = ["gpt2", "opt", "bloom", "falcon", "gpt_neox", "gemma", "qwen2"]


def make_model(name):
    import transformers

    config = config_of(name)
    cls = {
        "gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "bloom": "BloomForCausalLM",
        "falcon": "FalconForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
        "gemma": "GemmaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    }[name]
    return config, getattr(transformers, cls)


def worker(rank, ws, port, name, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    torch.manual_seed(0)
    config, cls = make_model(name)
    model = cls(config)
    fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    optim.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    os.chdir(out)
    msd, osd = get_state_dict(model, optim)
    # The optimizer state of issue 40's GPT-2 only: the others keep their fixtures small.
    dcp.save({"model": msd, "optim": osd} if name == "gpt2" else {"model": msd}, checkpoint_id="dcp")
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"full": full}, out / "full.pt")
    dist.barrier()
    if rank == 0:
        (out / "done").write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


def check_table():
    """Every row of the table is what transformers does."""
    import transformers

    for arch, (output, inp, default) in table().items():
        cls = getattr(transformers, arch)
        assert cls._tied_weights_keys == {output: inp}, f"{arch}: {cls._tied_weights_keys}"
        assert cls.config_class().tie_word_embeddings is default, f"{arch}: default"
    print(f"table: {len(table())} rows as transformers ties them")


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
    full = torch.load(out / "full.pt", weights_only=True)["full"]
    (out / "full.pt").unlink()

    config, cls = make_model(name)
    output, inp, _ = table()[cls.__name__]
    plain = cls(config)
    plain.load_state_dict(full)
    sd = plain.state_dict()
    assert list(sd) == list(full) and same_tensors(sd, full)
    got = read_dcp(out / "dcp")["model"]
    assert same_tensors(got, full), f"{name}: DCP model entries differ"
    assert output in got and inp in got and torch.equal(got[output], got[inp])
    plain.save_pretrained(out / "hf")
    files = sorted(p.name for p in (out / "hf").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"], files
    saved = st_names(out / "hf" / "model.safetensors")
    dropped = sorted(set(sd) - set(saved))
    assert dropped == [output] and set(saved) <= set(sd), f"{name}: dropped {dropped}"
    cfg = json.loads((out / "hf" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["architectures"] == [cls.__name__], cfg
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{name}: {cls.__name__} {len(sd)} keys, left out {dropped} (= {inp}), {size} bytes")


def main():
    names = sys.argv[1:] or NAMES
    for name in names:
        if name not in NAMES:
            raise SystemExit(f"unknown architecture {name!r}; known: {', '.join(NAMES)}")
    check_table()
    for name in names:
        run(name)


if __name__ == "__main__":
    main()

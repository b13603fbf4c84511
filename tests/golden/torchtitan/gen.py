"""A DCP checkpoint laid out as torchtitan saves one, from REAL PyTorch 2.13, for
`tests/it/hf.rs` (`convert --to hf` of a torchtitan checkpoint).

Run manually from the crate root with the project's venv, and commit the output:

    .venv/bin/python tests/golden/torchtitan/gen.py

torchtitan's `CheckpointManager` saves `dcp.save(states)` where `states` is
`_flattened_model_states_sd()`: the model's `get_model_state_dict` keys at the TOP level
(`ModelWrapper` flattened into the dict), beside the other stateful entries, which are not
flattened:

* `optimizer`: `OptimizersContainer.state_dict()`, i.e. `get_optimizer_state_dict(model, optim,
  options=StateDictOptions(flatten_optimizer_state_dict=True))`: keys `state.<fqn>.<name>`
  (`step`, `exp_avg`, `exp_avg_sq`; tensors) and `param_groups.<fqn>.<option>` (plain values);
* `lr_scheduler`: `LRSchedulersContainer.state_dict()`, the first `LambdaLR`'s `state_dict()`;
* `dataloader`: `ParallelAwareDataloader.state_dict()`, `{"dp_rank_0": pickle.dumps(state),
  "world_size": 1}`;
* `train_state`: `TrainState.state_dict()`, `{"step": int32 tensor, "ntokens_seen": int64
  tensor}`.

A tiny Llama-like model (the names torchtitan's Llama uses) takes one AdamW step. Single
process: `dcp.save(states, checkpoint_id=..., no_dist=True)`. Writes
`tests/golden/torchtitan/`:

* `ckpt/` — the DCP directory;
* `model.safetensors` — the model's `state_dict()` (`safetensors.torch.save_file`): what an
  export must hold, and nothing more.
"""

import functools
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR

ROOT = Path(__file__).resolve().parent


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention = Attention(dim)
        self.attention_norm = nn.RMSNorm(dim)


class Tiny(nn.Module):
    def __init__(self, vocab=16, dim=8, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        for b in self.layers.values():
            h = h + b.attention.wk(b.attention.wq(b.attention_norm(h)))
        return self.output(self.norm(h))


def linear_warmup(step, warmup):
    return min(1.0, (step + 1) / warmup)


def main():
    torch.manual_seed(0)
    model = Tiny()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = LambdaLR(optim, lr_lambda=functools.partial(linear_warmup, warmup=4))
    idx = torch.randint(0, 16, (2, 4))
    model(idx).logsumexp(-1).mean().backward()
    optim.step()
    sched.step()

    states = {
        "optimizer": get_optimizer_state_dict(
            model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
        ),
        "lr_scheduler": sched.state_dict(),
        "dataloader": {
            "dp_rank_0": pickle.dumps({"_sampler_iter_yielded": 1, "_num_yielded": 1}),
            "world_size": 1,
        },
        "train_state": {
            "step": torch.tensor(1, dtype=torch.int32),
            "ntokens_seen": torch.tensor(idx.numel(), dtype=torch.int64),
        },
    }
    # `_flattened_model_states_sd`: the model's keys at the top level.
    states.update(get_model_state_dict(model))
    assert any(k.startswith("state.") for k in states["optimizer"]), states["optimizer"].keys()

    ckpt = ROOT / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    dcp.save(states, checkpoint_id=str(ckpt), no_dist=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(ROOT / "model.safetensors"),
    )

    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    keys = sorted(md.state_dict_metadata)
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in keys, keys
    assert "train_state.step" in keys, keys
    assert "tok_embeddings.weight" in keys, keys
    print(f"wrote {ckpt} ({len(keys)} keys)")


if __name__ == "__main__":
    main()

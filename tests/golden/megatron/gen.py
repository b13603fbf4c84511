"""Golden fixtures from REAL Megatron-Core `dist_checkpointing` checkpoints (issue 43).

Pinned: torch 2.13.0 (PyPI's Linux wheel, run on the CPU), megatron-core 0.19.2 on Python
3.12.1 and megatron-core 0.16.1 on Python 3.11.7; megatron-bridge 0.6.2 is installed but cannot
be imported without its heavy dependencies, so the Bridge-style layout is written by this file
following megatron/bridge/training/checkpointing.py (see `bridge_layout`).

Regenerate (from the crate root; Megatron lives in its own venvs, never in `.venv`):

    scripts/setup-venv.sh && scripts/setup-megatron-venv.sh            # once
    /work/mcore19-venv/bin/python tests/golden/megatron/gen.py          # every 0.19.2 case
    /work/mcore16-venv/bin/python tests/golden/megatron/gen.py          # every 0.16.1 case
    /work/mcore19-venv/bin/python tests/golden/megatron/gen.py dp2      # only the named cases
    .venv/bin/python tests/golden/megatron/check_format.py              # then check them

Each case runs `python -m torch.distributed.run --nproc-per-node N` (gloo, CPU,
OMP_NUM_THREADS=1) on this file with `--worker`: a tiny Llama-like GPTModel (local layer spec,
RMSNorm, RoPE, GQA, SwiGLU, no biases, padded vocabulary), wrapped in Megatron's
DistributedDataParallel (and Float16Module for bf16), Megatron's Adam, one training step, then
`dist_checkpointing.save` in `torch_dist`. Then, in one process (world size 1, TP 1, PP 1), it
loads the model back with Megatron (resharding) and records fp32 logits for a fixed input, and
without Megatron runs torch's `dcp_to_torch_save` on the directory. The Rust tests never run
this script.

Files of a case folder `v<mcore version>/<case>/`:
* `ckpt/` — the `torch_dist` directory as written (`.metadata`, `__R_K.distcp`,
  `metadata.json`, and `common.pt` for 0.16), or for the tree cases the Megatron-LM /
  Bridge tree around it (`latest_checkpointed_iteration.txt`, `iter_0000001/`, ...).
* `expected.safetensors` — every tensor of `dcp_to_torch_save`'s output, keyed by its flat
  DCP key (e.g. `decoder.layers.mlp.linear_fc1.weight`,
  `optimizer.state.exp_avg.decoder...`, `optimizer.distributed.dp_group_idx_0.gbuf_idx_0.
  dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg`).
* `expected_objects.json` — the non-tensor items of that output (bytes items): key, byte
  length, sha256, and what `torch.load(weights_only=False)` of them gives, in short.
* `logits.safetensors` — `tokens` (int64 [1, S]) and `logits` (fp32 [1, S, padded vocab]) of
  the checkpointed model loaded into a TP1/PP1 Megatron GPTModel.
* `case.json` — the case's settings, padded vocab, versions, and the per-rank layout of the
  optimizer buffers (param name -> bucket, [start, end) in the bucket) as Megatron reports
  it, for the bucket-rule check (check_format.py), plus the loss of the step.

Determinism: Python's, numpy's and torch's RNGs are seeded; regenerating repeats every file
except (FORMAT.md section 7) `.metadata` (a fresh save_id UUID; in 0.16.1 also the order of
storage_data) and, in dp_reshardable cases, the bucket gap chunks (Megatron fills them with
torch.empty) in the `.distcp` files and in `expected.safetensors`.
"""

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import warnings

warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 1234
SEQ = 8
MICRO_BATCH = 2
VOCAB = 20  # padded to a multiple of MAKE_VOCAB_DIVISIBLE_BY * TP: 24 at TP 1, 32 at TP 2
MAKE_VOCAB_DIVISIBLE_BY = 8
MODEL = dict(num_layers=2, hidden_size=8, num_attention_heads=4, num_query_groups=2,
             kv_channels=2, ffn_hidden_size=16)
# Adam, as Megatron-LM's defaults but larger lr, no clipping (clip_grad=0: its grad-norm path
# calls CUDA multi-tensor kernels).
ADAM = dict(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)

# name -> settings. ws = world size; opt = "plain" (non-distributed optimizer) or a
# distrib_optim_sharding_type; tied = share_embeddings_and_output_weights; bucket = DDP
# bucket_size (elements; needs overlap_grad_reduce) or None (one bucket per buffer);
# layout: "dcp" (the torch_dist directory alone), "mlm" (Megatron-LM tree), "bridge".
def case(ws, tp=1, pp=1, opt="dp_reshardable", tied=False, bf16=False, bucket=None,
         layout="dcp", versions=("0.19.2", "0.16.1")):
    return dict(ws=ws, tp=tp, pp=pp, opt=opt, tied=tied, bf16=bf16, bucket=bucket,
                layout=layout, versions=versions)

V19 = ("0.19.2",)
CASES = {
    # one run (seed, data, DP 2) in three optimizer layouts: equal Adam states
    "dp2": case(2),
    "dp2_fully_reshardable": case(2, opt="fully_reshardable"),
    "dp2_dp_zero_gather_scatter": case(2, opt="dp_zero_gather_scatter", versions=V19),
    # the same run with several buckets per buffer (overlap_grad_reduce, a small bucket_size)
    "dp2_buckets": case(2, bucket=300, versions=V19),
    # model parallel, plain (non-distributed) optimizer
    "tp2": case(2, tp=2, opt="plain", versions=V19),
    "pp2": case(2, pp=2, opt="plain", versions=V19),
    # PP x DP with tied embeddings (word embeddings on stage 0, their copy on stage 1).
    # fully_reshardable: dp_reshardable fails in Megatron 0.19.2 itself here (FORMAT.md)
    "pp2dp2_tied": case(4, pp=2, tied=True, opt="fully_reshardable", versions=V19),
    # TP x DP: the Megatron-LM tree (dp_reshardable, its default) and fully_reshardable
    "mlm_tp2dp2": case(4, tp=2, layout="mlm", versions=V19),
    "tp2dp2_fully_reshardable": case(4, tp=2, opt="fully_reshardable", versions=V19),
    # bf16 (Float16Module): the Bridge tree (dp_reshardable) and the plain optimizer
    "bridge_bf16_dp2": case(2, bf16=True, layout="bridge", versions=V19),
    "bf16_dp2_plain": case(2, bf16=True, opt="plain", versions=V19),
    # 0.16.1 only
    "bf16_dp2": case(2, bf16=True, versions=("0.16.1",)),
}


def padded_vocab(tp):
    multiple = MAKE_VOCAB_DIVISIBLE_BY * tp
    return ((VOCAB + multiple - 1) // multiple) * multiple


def seed_all(seed):
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------
# CUDA shims: Megatron calls CUDA in a few places even on the CPU.
# --------------------------------------------------------------------------------------------
def install_cuda_shims():
    import torch
    from torch.overrides import TorchFunctionMode

    class _Stream:
        def wait_stream(self, *a, **k): pass
        def synchronize(self): pass
        def wait_event(self, *a, **k): pass
        def record_event(self, *a, **k): return _Event()
        def __enter__(self): return self
        def __exit__(self, *a): return False

    class _Event:
        def __init__(self, *a, **k): pass
        def record(self, *a, **k): pass
        def wait(self, *a, **k): pass
        def synchronize(self): pass
        def query(self): return True

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.default_stream = lambda *a, **k: _Stream()
    torch.cuda.Stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.Event = _Event
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.manual_seed_all = lambda *a, **k: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None

    _orig_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw:
            name = _orig_type(self)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return _orig_type(self, dtype, non_blocking, **kw)

    torch.Tensor.type = _type
    torch.Tensor.cuda = lambda self, *a, **k: self

    def _cpu(dev):
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return torch.device("cpu")
        if isinstance(dev, str) and dev.startswith("cuda"):
            return "cpu"
        if isinstance(dev, int) and not isinstance(dev, bool):
            return "cpu"
        return dev

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            if func in (torch.Tensor.to,) and args:
                args = tuple(_cpu(a) if i > 0 else a for i, a in enumerate(args))
            return func(*args, **kwargs)

    mode = CudaToCpu()
    mode.__enter__()
    return mode


# --------------------------------------------------------------------------------------------
# The worker: one rank of one case.
# --------------------------------------------------------------------------------------------
def build_model(c, mc, tp, pp, pre, post):
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        **MODEL,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        bf16=c["bf16"],
        params_dtype=torch.bfloat16 if c["bf16"] else torch.float32,
        pipeline_dtype=torch.bfloat16 if c["bf16"] else torch.float32,
        init_method_std=0.02,
        layernorm_epsilon=1e-5,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=c["padded_vocab"],
        max_sequence_length=SEQ,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=c["tied"],
        position_embedding_type="rope",
        rotary_base=10000,
        parallel_output=True,
    )
    return config, model


def batch_for(dp_rank):
    import torch
    g = torch.Generator().manual_seed(SEED + 1 + dp_rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def fixed_input():
    import torch
    g = torch.Generator().manual_seed(SEED + 99)
    return torch.randint(0, VOCAB, (1, SEQ), generator=g)


def worker(name, out):
    c = dict(CASES[name])
    tp, pp = c["tp"], c["pp"]
    c["padded_vocab"] = padded_vocab(tp)
    import torch
    import torch.distributed as dist
    install_cuda_shims()
    import megatron.core as mc
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    seed_all(SEED)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True)
    seed_all(SEED)
    pre = parallel_state.is_pipeline_first_stage()
    post = parallel_state.is_pipeline_last_stage()
    config, model = build_model(c, mc, tp, pp, pre, post)
    if c["bf16"]:
        model = Float16Module(config, model)
    dist_opt = c["opt"] != "plain"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=c["bucket"] is not None,
        bucket_size=c["bucket"],
        use_distributed_optimizer=dist_opt,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", **ADAM, clip_grad=0.0, bf16=c["bf16"],
                        params_dtype=torch.bfloat16 if c["bf16"] else torch.float32,
                        use_distributed_optimizer=dist_opt),
        [ddp],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = opt.scale_loss

    dp_rank = parallel_state.get_data_parallel_rank()
    tokens, labels = batch_for(dp_rank)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ)

    def forward_step(data_iterator, model):
        t, l = next(data_iterator)
        output = model(t, position_ids, None, labels=l)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}
        return output, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([(tokens, labels)]), model=[ddp],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
    ok, grad_norm, _ = opt.step()
    assert ok, "optimizer step skipped"
    loss = float(losses[0]["loss"]) if losses else None

    # What the sharded state dicts are built with: Megatron-LM's / Bridge's metadata.
    md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if dist_opt:
        md["distrib_optim_sharding_type"] = c["opt"]
    md_saved = dict(md)
    sd = {}
    if c["layout"] in ("mlm", "bridge"):
        sd["checkpoint_version"] = 3.0
        sd["iteration"] = 1
    # Megatron-LM's save_checkpoint unwraps DDP and Float16Module first (unwrap_model)
    bare = ddp
    while hasattr(bare, "module"):
        bare = bare.module
    sd["model"] = bare.sharded_state_dict(metadata=md)
    sd["optimizer"] = opt.sharded_state_dict(sd["model"], metadata=md)
    if c["layout"] in ("mlm", "bridge"):
        extra_state(sd, c, tp, pp, loss)

    ckpt = os.path.join(out, "ckpt")
    if c["layout"] in ("mlm", "bridge"):
        ckpt_dir = os.path.join(ckpt, "iter_0000001")
    else:
        ckpt_dir = ckpt
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    if c["layout"] == "mlm":
        # Megatron-LM's default (--ckpt-fully-parallel-save): spread replicated shards over DP
        from megatron.core.dist_checkpointing.strategies.fully_parallel import \
            FullyParallelSaveStrategyWrapper
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    kw = {}
    if "content_metadata" in dist_checkpointing.save.__code__.co_varnames:
        kw["content_metadata"] = md
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=strategy, **kw)
    dist.barrier()
    if rank == 0 and c["layout"] in ("mlm", "bridge"):
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    if c["layout"] == "bridge" and rank == 0:
        bridge_files(ckpt, c)

    layout = bucket_layout(ddp, opt) if dist_opt else None
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, dict(rank=rank, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                         pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                                         dp_rank=dp_rank, loss=loss, buffers=layout))
    if rank == 0:
        info = dict(c, case=name, megatron_core=mc.__version__, torch=torch.__version__,
                    python=sys.version.split()[0], seed=SEED, seq=SEQ, micro_batch=MICRO_BATCH,
                    vocab=VOCAB, make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY,
                    model=MODEL, adam=ADAM, metadata=md_saved, ranks=layouts)
        with open(os.path.join(out, "case.json"), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
    dist.barrier()
    dist.destroy_process_group()


def bucket_layout(ddp, opt):
    """Megatron's own account of where each parameter lies in each bucket (this rank)."""
    name_of = {}
    for n, p in ddp.module.named_parameters():
        name_of[p] = n
    out = []
    for gi, buf in enumerate(ddp.buffers + ddp.expert_parallel_buffers):
        b = dict(gbuf_idx=gi, param_dtype=str(buf.param_dtype), grad_dtype=str(buf.grad_dtype),
                 numel=buf.numel, numel_unpadded=buf.numel_unpadded, params=[], buckets=[])
        for p, (start, end, bucket_id) in buf.param_index_map.items():
            b["params"].append(dict(name=name_of[p], shape=list(p.shape), start=start, end=end,
                                    bucket=bucket_id))
        b["params"].sort(key=lambda x: x["start"])
        for bk in buf.buckets:
            b["buckets"].append(dict(offset=bk.offset, numel=bk.grad_data.numel(),
                                     numel_unpadded=bk.numel_unpadded))
        out.append(b)
    return out


def extra_state(sd, c, tp, pp, loss):
    """The rest of Megatron-LM's / Bridge's `generate_state_dict` (megatron/training/
    checkpointing.py, megatron/bridge/training/checkpointing.py): args, iteration, the
    scheduler, RNG states as a ShardedObject over (PP, TP) with the DP rank as replica id."""
    import argparse
    import numpy as np
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    rng_state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    sd["rng_state"] = ShardedObject(
        "rng_state", [rng_state], (pp, tp),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
    sd["opt_param_scheduler"] = {
        "max_lr": ADAM["lr"], "lr_warmup_steps": 0, "num_steps": MICRO_BATCH * c["ws"] // (tp * pp),
        "lr_decay_style": "constant", "lr_decay_steps": 1, "min_lr": ADAM["lr"],
        "start_wd": ADAM["weight_decay"], "end_wd": ADAM["weight_decay"],
        "wd_incr_style": "constant", "wd_incr_steps": 1,
    }
    if c["layout"] == "mlm":
        dp = c["ws"] // (tp * pp)
        sd["args"] = argparse.Namespace(
            num_layers=MODEL["num_layers"], hidden_size=MODEL["hidden_size"],
            ffn_hidden_size=MODEL["ffn_hidden_size"],
            num_attention_heads=MODEL["num_attention_heads"],
            num_query_groups=MODEL["num_query_groups"], group_query_attention=True,
            kv_channels=MODEL["kv_channels"], max_position_embeddings=SEQ, seq_length=SEQ,
            padded_vocab_size=c["padded_vocab"], vocab_size=VOCAB,
            make_vocab_size_divisible_by=MAKE_VOCAB_DIVISIBLE_BY,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            data_parallel_size=dp, world_size=c["ws"], virtual_pipeline_model_parallel_size=None,
            context_parallel_size=1, expert_model_parallel_size=1,
            normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
            rotary_base=10000, untie_embeddings_and_output_weights=not c["tied"],
            add_bias_linear=False, transformer_impl="local", bf16=c["bf16"], fp16=False,
            params_dtype=torch.bfloat16 if c["bf16"] else torch.float32,
            use_distributed_optimizer=c["opt"] != "plain", optimizer="adam", lr=ADAM["lr"],
            weight_decay=ADAM["weight_decay"], adam_beta1=ADAM["adam_beta1"],
            adam_beta2=ADAM["adam_beta2"], adam_eps=ADAM["adam_eps"], clip_grad=0.0,
            micro_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * dp,
            ckpt_format="torch_dist", iteration=1, consumed_train_samples=MICRO_BATCH * dp,
            seed=SEED,
        )
        sd["num_floating_point_operations_so_far"] = 0
        sd["rerun_state_machine"] = None


def bridge_files(ckpt, c):
    """Megatron-Bridge's extra files (megatron/bridge/training/checkpointing.py,
    save_checkpoint's train_state_finalize_fn): iter_NNNNNNN/train_state.pt (TrainState.
    state_dict() with the flops as fp32), a copy as latest_train_state.pt, the tracker, and
    iter_NNNNNNN/run_config.yaml (ConfigContainer.to_yaml; here a small hand-written subset
    with the fields Bridge's loader reads: model.tensor/pipeline_model_parallel_size,
    checkpoint.save_rng, ...)."""
    import torch
    train_state = {
        "step": torch.tensor(1, dtype=torch.int64),
        "consumed_train_samples": torch.tensor(MICRO_BATCH * c["ws"], dtype=torch.int64),
        "skipped_train_samples": torch.tensor(0, dtype=torch.int64),
        "consumed_valid_samples": torch.tensor(0, dtype=torch.int64),
        "floating_point_operations_so_far": torch.tensor(0.0, dtype=torch.float32),
        "do_train": torch.tensor(True, dtype=torch.bool),
        "do_valid": torch.tensor(False, dtype=torch.bool),
        "do_test": torch.tensor(False, dtype=torch.bool),
    }
    local = os.path.join(ckpt, "iter_0000001", "train_state.pt")
    torch.save(train_state, local)
    shutil.copy(local, os.path.join(ckpt, "latest_train_state.pt"))
    m = MODEL
    yaml = f"""_target_: megatron.bridge.training.config.ConfigContainer
checkpoint:
  _target_: megatron.bridge.training.config.CheckpointConfig
  ckpt_format: torch_dist
  save_optim: true
  save_rng: true
  dist_ckpt_optim_fully_reshardable: false
model:
  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider
  num_layers: {m['num_layers']}
  hidden_size: {m['hidden_size']}
  ffn_hidden_size: {m['ffn_hidden_size']}
  num_attention_heads: {m['num_attention_heads']}
  num_query_groups: {m['num_query_groups']}
  kv_channels: {m['kv_channels']}
  normalization: RMSNorm
  gated_linear_unit: true
  add_bias_linear: false
  position_embedding_type: rope
  share_embeddings_and_output_weights: {str(c['tied']).lower()}
  seq_length: {SEQ}
  vocab_size: {c['padded_vocab']}
  make_vocab_size_divisible_by: {MAKE_VOCAB_DIVISIBLE_BY}
  tensor_model_parallel_size: {c['tp']}
  pipeline_model_parallel_size: {c['pp']}
  bf16: {str(c['bf16']).lower()}
optimizer:
  _target_: megatron.core.optimizer.optimizer_config.OptimizerConfig
  optimizer: adam
  lr: {ADAM['lr']}
  weight_decay: {ADAM['weight_decay']}
  use_distributed_optimizer: {str(c['opt'] != 'plain').lower()}
train:
  micro_batch_size: {MICRO_BATCH}
  global_batch_size: {MICRO_BATCH * c['ws'] // (c['tp'] * c['pp'])}
"""
    with open(os.path.join(ckpt, "iter_0000001", "run_config.yaml"), "w") as f:
        f.write(yaml)


# --------------------------------------------------------------------------------------------
# One process after the run: Megatron's logits (TP1/PP1 reload), dcp_to_torch_save's output.
# --------------------------------------------------------------------------------------------
def logits_worker(name, out):
    c = dict(CASES[name])
    c["padded_vocab"] = padded_vocab(c["tp"])  # the checkpoint's padding, not TP1's
    import torch
    import torch.distributed as dist
    install_cuda_shims()
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.transformer.module import Float16Module
    seed_all(SEED)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True)
    config, model = build_model(c, None, 1, 1, True, True)
    if c["bf16"]:
        model = Float16Module(config, model)
    bare = model.module if c["bf16"] else model
    sd = bare.sharded_state_dict(metadata={"singleton_local_shards": False})
    ckpt_dir = checkpoint_dir(os.path.join(out, "ckpt"))
    loaded = dist_checkpointing.load({"model": sd}, ckpt_dir)
    model.load_state_dict(loaded["model"], strict=False)
    model.eval()
    tokens = fixed_input()
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).unsqueeze(0), None).float().contiguous()
    from safetensors.torch import save_file
    save_file({"tokens": tokens.contiguous(), "logits": logits},
              os.path.join(out, "logits.safetensors"))
    dist.destroy_process_group()


def checkpoint_dir(root):
    """The torch_dist directory of a fixture: the root itself, or the iteration that
    Megatron-LM's tracker names."""
    t = os.path.join(root, "latest_checkpointed_iteration.txt")
    if os.path.exists(t):
        with open(t) as f:
            it = f.read().strip()
        return os.path.join(root, "release" if it == "release" else f"iter_{int(it):07d}")
    return root


def expected_outputs(out):
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    ckpt_dir = checkpoint_dir(os.path.join(out, "ckpt"))
    tmp = os.path.join(out, "_dcp_to_torch_save.pt")
    dcp_to_torch_save(ckpt_dir, tmp)
    sd = torch.load(tmp, weights_only=False)
    os.remove(tmp)
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else k, x)
        else:
            flat[prefix] = v
    walk("", sd)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    meta = FileSystemReader(ckpt_dir).read_metadata()
    tensors, objects = {}, []
    for k in sorted(flat):
        v = flat[k]
        if isinstance(v, torch.Tensor):
            tensors[k] = v.contiguous()
            continue
        entry = dict(key=k, loaded_type=f"{type(v).__module__}.{type(v).__qualname__}",
                     loaded=describe(v))
        if isinstance(meta.state_dict_metadata.get(k), BytesStorageMetadata):
            info = meta.storage_data[MetadataIndex(k)]
            with open(os.path.join(ckpt_dir, info.relative_path), "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            entry.update(file=info.relative_path, offset=info.offset, len=info.length,
                         sha256=hashlib.sha256(raw).hexdigest(),
                         zip=raw[:4] == b"PK\x03\x04")
        objects.append(entry)
    save_file(tensors, os.path.join(out, "expected.safetensors"))
    with open(os.path.join(out, "expected_objects.json"), "w") as f:
        json.dump(objects, f, indent=1)
        f.write("\n")


def describe(obj, depth=0):
    import torch
    if depth > 3:
        return type(obj).__name__
    if isinstance(obj, torch.Tensor):
        return f"Tensor({str(obj.dtype)}, {list(obj.shape)})"
    if isinstance(obj, dict):
        return {str(k): describe(v, depth + 1) for k, v in list(obj.items())[:40]}
    if isinstance(obj, (list, tuple)):
        return [describe(v, depth + 1) for v in obj[:8]] + (["..."] if len(obj) > 8 else [])
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def run_case(name):
    import megatron.core as mc
    c = CASES[name]
    ver = mc.__version__
    if ver not in c["versions"]:
        return False
    out = os.path.join(HERE, f"v{ver}", name)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", MASTER_ADDR="127.0.0.1",
               CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    log = open(os.path.join(out, "_log.txt"), "w")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(c["ws"]),
           "--master-port", "29533", __file__, "--worker", name, out]
    r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"{name}: worker failed, see {out}/_log.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-port", "29534", __file__, "--logits", name, out]
    r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"{name}: logits failed, see {out}/_log.txt")
    log.close()
    expected_outputs(out)
    os.remove(os.path.join(out, "_log.txt"))
    print(f"{name}: {out}", flush=True)
    return True


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    if len(sys.argv) > 1 and sys.argv[1] == "--logits":
        return logits_worker(sys.argv[2], sys.argv[3])
    names = sys.argv[1:] or list(CASES)
    for n in names:
        if n not in CASES:
            raise SystemExit(f"unknown case {n}; known: {', '.join(CASES)}")
        run_case(n)


if __name__ == "__main__":
    main()

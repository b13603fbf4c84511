"""The tiny model, data and loss of the DeepSpeed golden fixtures (`gen.py` beside this file).

Plain PyTorch, no DeepSpeed: a test (for example an FSDP2 load test) can import this module
and rebuild the exact model, its two optimizer param groups, the training batches and the loss.

Parameter numels are odd on purpose so that ZeRO's alignment padding and partitions that cut a
parameter across ranks both occur at world size 2 (see FORMAT.md). `named_parameters()` order:

    name           shape     numel  group
    shift          (3,)          3  1 (no decay)   top-level parameters come first
    logit_scale    (1,)          1  1 (no decay)   one element (DeepSpeed 0.19.8 cannot
                                                   broadcast a 0-dim parameter at init)
    emb.weight     (37, 12)    444  0 (decay)      tied: head_lm.weight is the same Parameter
    fc1.weight     (23, 12)    276  0 (decay)
    fc1.bias       (23,)        23  1 (no decay)
    norm.weight    (23,)        23  1 (no decay)
    norm.bias      (23,)        23  1 (no decay)
    head.weight    (5, 23)     115  0 (decay)

`head_lm.weight` is tied to `emb.weight` (one Parameter, two names): `named_parameters()` lists
it once (as `emb.weight`), `state_dict()` lists both. Buffers: `pos_scale` (12,) persistent,
`scratch` (2,) non-persistent (not in `state_dict()`).

The frozen variant (issue 40, `build_model(frozen=True)`): `emb.weight` has `requires_grad=False`
(and with it the tied `head_lm.weight`, the same Parameter), as when fine-tuning with a frozen
embedding; the optimizer (`make_optimizer(model, torch.optim.AdamW)`) gets the trainable
parameters only, in the same two groups (group 0 without `emb.weight`).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 37
HIDDEN = 12
FFN = 23
CLASSES = 5
BATCH = 4  # micro batch per rank
SEQ = 6

MODEL_SEED = 1234
DATA_SEED = 5678
CONTINUE_SEED = 999

# Two param groups with different hyperparameters (torch.optim.Adam: weight_decay is L2 added
# to the gradient, not decoupled). Group 0 first, in this member order; group 1 second.
DECAY_NAMES = ["emb.weight", "fc1.weight", "head.weight"]
NO_DECAY_NAMES = ["fc1.bias", "norm.weight", "norm.bias", "shift", "logit_scale"]
GROUP_HPARAMS = [
    {"lr": 1e-2, "weight_decay": 0.1},
    {"lr": 3e-3, "weight_decay": 0.0},
]
ADAM_KWARGS = {"betas": (0.9, 0.95), "eps": 1e-6}


class TinyModel(nn.Module):

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(3) * 0.1)
        self.logit_scale = nn.Parameter(torch.tensor([1.25]))
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN, bias=True)
        self.norm = nn.LayerNorm(FFN)
        self.head = nn.Linear(FFN, CLASSES, bias=False)
        self.head_lm = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head_lm.weight = self.emb.weight  # tied
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, HIDDEN))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, ids):
        x = self.emb(ids) * self.pos_scale.to(self.emb.weight.dtype)
        x = x + F.pad(self.shift, (0, HIDDEN - 3))
        h = self.norm(F.gelu(self.fc1(x)))
        logits = self.head(h) * self.logit_scale
        lm_logits = self.head_lm(x)
        return logits, lm_logits


# The frozen variant's frozen parameters.
FROZEN_NAMES = ["emb.weight"]


def build_model(frozen=False):
    """The model with its deterministic initial weights (fp32); with `frozen`, FROZEN_NAMES
    do not require grad."""
    torch.manual_seed(MODEL_SEED)
    model = TinyModel()
    if frozen:
        named = dict(model.named_parameters())
        for n in FROZEN_NAMES:
            named[n].requires_grad_(False)
    return model


def group_members(model):
    """The names of each optimizer group: DECAY_NAMES / NO_DECAY_NAMES, trainable ones only."""
    named = dict(model.named_parameters())
    assert sorted(named) == sorted(DECAY_NAMES + NO_DECAY_NAMES), sorted(named)
    return [[n for n in names if named[n].requires_grad] for names in (DECAY_NAMES, NO_DECAY_NAMES)]


def param_groups(model):
    """The optimizer input: two groups, members in DECAY_NAMES / NO_DECAY_NAMES order (the
    trainable ones)."""
    named = dict(model.named_parameters())
    return [{"params": [named[n] for n in names], **hp} for names, hp in zip(group_members(model), GROUP_HPARAMS)]


def make_optimizer(model, cls=torch.optim.Adam):
    return cls(param_groups(model), **ADAM_KWARGS)


def batch(seed):
    """(ids, targets): ids (BATCH, SEQ) int64 in [0, VOCAB), targets (BATCH, SEQ) in [0, CLASSES)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, CLASSES, (BATCH, SEQ), generator=g)
    return ids, targets


def train_batch(step, rank):
    """The batch rank `rank` trains on at step `step` (0-based): different on every rank."""
    return batch(DATA_SEED + 1000 * step + rank)


def continue_batch():
    """The one batch of the continuation step: the SAME on every rank, so the data-parallel
    mean gradient equals this batch's gradient whatever the world size."""
    return batch(CONTINUE_SEED)


def loss_fn(model, ids, targets):
    """Mean cross entropy of the class head plus 0.5 x next-token loss of the tied LM head,
    computed in fp32 from the logits (whatever the model dtype)."""
    logits, lm_logits = model(ids)
    cls = F.cross_entropy(logits.float().reshape(-1, CLASSES), targets.reshape(-1))
    lm = F.cross_entropy(lm_logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return cls + 0.5 * lm

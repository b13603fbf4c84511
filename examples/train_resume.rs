//! End to end: a small transformer language model trained FSDP-style, checkpointed at one world
//! size and resumed at another.
//!
//! A decoder-only transformer (token and position embeddings, 2 blocks of causal self-attention
//! and MLP with layer norms, LM head) written with `tch::nn` learns a synthetic Markov chain.
//! Each rank keeps only its shards of the flat parameters and of the Adam state. Every step:
//!
//! 1. **all-gather** every flat parameter from the ranks' shards and copy its members into this
//!    rank's `VarStore` (the unsharded parameters the forward pass uses);
//! 2. **forward/backward** on this rank's slice of the global batch (8 sequences per step, the
//!    same for any world size that divides 8);
//! 3. **reduce-scatter** (average) each flat parameter's gradient, flattened in layout order
//!    with zero padding, into this rank's gradient shard;
//! 4. **sharded Adam** step on the shards (this crate's Adam, torch's numerics);
//! 5. at step K, a **sharded checkpoint**: optimizer state and parameter shards.
//!
//! The default run, all on thread ranks in one process: 4 ranks train N steps uninterrupted
//! (saving the checkpoint at step K on the way), then 2 ranks with a different wrapping (a unit
//! per sub-layer, the LM head ignored by FSDP and kept whole on every rank) load the checkpoint
//! and train steps K+1..N. The resumed losses must equal the uninterrupted ones
//! within a relative tolerance (see [`REL_TOL`]); the example prints both curves and exits
//! with an error otherwise.
//!
//! ```text
//! PATH=$PWD/.venv/bin:$PATH LIBTORCH_USE_PYTORCH=1 cargo run --release --example train_resume --features tch
//! ```
//!
//! The two halves also run separately, e.g. one process per rank under `mpirun` (feature
//! `mpi`; see [`launcher_world`]):
//!
//! ```text
//! train_resume --phase train  --ckpt DIR --curve FILE [--world-size 4]   # N steps, saves at K
//! train_resume --phase resume --ckpt DIR --curve FILE [--world-size 2]   # K+1..N, compares
//! ```
//!
//! Options: `--steps N` (default 60), `--save-at K` (default 30); `--world-size` sets the
//! number of thread ranks (under a launcher the launcher decides).
//!
//! **FSDP2** (`--fsdp 2`; the default is `--fsdp 1`, the flat parameters above): the same model
//! trained as PyTorch's `fully_shard` trains it (see `train_resume/fsdp2.rs`). Each parameter is
//! sharded on dim 0 (`torch.chunk` rows per rank, [`fsdp::param_layout`]); the units are the
//! modules `fully_shard` was applied to (`WrapPolicy::fully_shard`). Every step, each unit's
//! parameters are unsharded by FSDP2's all-gather (`foreach_all_gather` and copy-out), each
//! unit's gradients are sharded by FSDP2's reduce-scatter (`foreach_reduce`, averaging as
//! `_get_gradient_divide_factors` picks for fp32), and Adam steps the local rows. At step K the
//! ranks save a DCP checkpoint, model and optimizer (`FullyShardedModel::save_dcp`), which the
//! resume phase loads at another world size and wrapping (`load_model_dcp`, `load_dcp`), and
//! which PyTorch loads too: with `--phase train --fsdp 2` the curve file also holds the batches
//! of the steps after K, and `examples/train_resume_torch.py CKPT CURVE` continues the run in a
//! real PyTorch FSDP2 model and compares its losses with these (`scripts/run-example-fsdp2.sh`
//! runs all three).

use fsdp::checkpoint::{LoadOptions, SaveOptions};
use fsdp::collectives::{ProcessGroup, ReduceOp, ThreadGroup};
use fsdp::flat_param::{flatten_padded, unflatten_full};
use fsdp::libtorch::{model_desc_from_var_store_in_order, var_store_params_in_order};
use fsdp::optim::{Adam, AdamConfig, Optimizer};
use fsdp::param_shards::shard_tensors;
use fsdp::{
    DType, Fsdp, HostTensor, ModelDesc, OptimParam, OptimParams, OptimStateDict, TchTensor, Value,
    WrapPolicy,
};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[path = "train_resume/fsdp2.rs"]
mod fsdp2;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxResult<T> = std::result::Result<T, BoxError>;
/// `(step, global mean loss)` per trained step; steps count from 1.
type Curve = Vec<(usize, f64)>;

// ---------------------------------------------------------------------------------------------
// Configuration

const VOCAB: i64 = 64;
const D_MODEL: i64 = 32;
const HEADS: i64 = 4;
const CONTEXT: i64 = 16;
const LAYERS: usize = 2;
/// Sequences per step over all ranks; each rank takes `GLOBAL_BATCH / world_size` of them.
const GLOBAL_BATCH: usize = 8;
const LR: f64 = 1e-2;
const INIT_SEED: i64 = 1234;
const DATA_SEED: u64 = 42;
const DEFAULT_STEPS: usize = 60;
const DEFAULT_SAVE_AT: usize = 30;

/// Largest accepted `|resumed - uninterrupted| / |uninterrupted|` per step.
///
/// The resumed run differs from the uninterrupted one only in how float sums are associated:
/// each rank averages 2 sequences and 4 ranks average those (world size 4), or 4 sequences and
/// 2 ranks (world size 2), and libtorch's matmuls see other batch shapes. That perturbs
/// gradients by a few f32 ulps (relative ~1e-7); Adam's update `m / (sqrt(v) + eps)` is
/// scale-free, so the perturbation stays relative and the losses agree to ~1e-6 after tens of
/// steps. 1e-4 leaves a wide margin for that while a real resume bug — a lost or reset Adam
/// state (bias correction restarts), a wrong or stale parameter shard, a data offset — moves
/// the loss by 1e-3 or more.
const REL_TOL: f64 = 1e-4;

/// The wrapping while training (world size 4): each block is an FSDP unit, the root unit
/// takes the rest.
fn train_policy() -> WrapPolicy {
    WrapPolicy::units(&["blocks.0", "blocks.1", ""])
}

/// The wrapping after resuming (world size 2), different on purpose: one unit per sub-layer,
/// the root, and the LM head ignored by FSDP (an unmanaged parameter: kept whole on every rank,
/// its gradient all-reduced).
fn resume_policy() -> WrapPolicy {
    WrapPolicy::units(&[
        "blocks.0.attn",
        "blocks.0.mlp",
        "blocks.1.attn",
        "blocks.1.mlp",
        "",
    ])
    .with_ignored(&["head"])
}

// ---------------------------------------------------------------------------------------------
// The model

struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    attn_proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    mlp_proj: nn::Linear,
}

/// A decoder-only transformer language model.
struct Gpt {
    tok_emb: nn::Embedding,
    pos_emb: nn::Embedding,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    fn new(p: &nn::Path) -> Gpt {
        let ln = |p: nn::Path| nn::layer_norm(p, vec![D_MODEL], Default::default());
        let lin = |p: nn::Path, i, o| nn::linear(p, i, o, Default::default());
        let emb_cfg = nn::EmbeddingConfig {
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: 0.1,
            },
            ..Default::default()
        };
        Gpt {
            tok_emb: nn::embedding(p / "tok_emb", VOCAB, D_MODEL, emb_cfg),
            pos_emb: nn::embedding(p / "pos_emb", CONTEXT, D_MODEL, emb_cfg),
            blocks: (0..LAYERS)
                .map(|i| {
                    let b = p / "blocks" / i;
                    Block {
                        ln1: ln(&b / "ln1"),
                        qkv: lin(&b / "attn" / "qkv", D_MODEL, 3 * D_MODEL),
                        attn_proj: lin(&b / "attn" / "proj", D_MODEL, D_MODEL),
                        ln2: ln(&b / "ln2"),
                        fc: lin(&b / "mlp" / "fc", D_MODEL, 4 * D_MODEL),
                        mlp_proj: lin(&b / "mlp" / "proj", 4 * D_MODEL, D_MODEL),
                    }
                })
                .collect(),
            ln_f: ln(p / "ln_f"),
            head: nn::linear(
                p / "head",
                D_MODEL,
                VOCAB,
                // Small logits at first: the initial loss is close to ln(VOCAB).
                nn::LinearConfig {
                    ws_init: nn::Init::Randn {
                        mean: 0.0,
                        stdev: 0.02,
                    },
                    bias: false,
                    ..Default::default()
                },
            ),
        }
    }

    /// The parameter names in the order the equivalent PyTorch module registers them
    /// (`named_parameters()`): tch creates a linear layer's bias before its weight.
    fn param_order() -> Vec<String> {
        let mut names = vec!["tok_emb.weight".to_string(), "pos_emb.weight".to_string()];
        for i in 0..LAYERS {
            for m in ["ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj"] {
                names.push(format!("blocks.{i}.{m}.weight"));
                names.push(format!("blocks.{i}.{m}.bias"));
            }
        }
        names.extend([
            "ln_f.weight".into(),
            "ln_f.bias".into(),
            "head.weight".into(),
        ]);
        names
    }

    fn attention(b: &Block, x: &Tensor) -> Tensor {
        let (n, t, d) = x.size3().expect("[batch, time, d_model]");
        let heads = |y: Tensor| y.view([n, t, HEADS, d / HEADS]).transpose(1, 2);
        let qkv = b.qkv.forward(x).split(D_MODEL, -1);
        let (q, k, v) = (
            heads(qkv[0].shallow_clone()),
            heads(qkv[1].shallow_clone()),
            heads(qkv[2].shallow_clone()),
        );
        let causal = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).triu(1);
        let att = (q.matmul(&k.transpose(-2, -1)) / ((d / HEADS) as f64).sqrt())
            .masked_fill(&causal, f64::NEG_INFINITY)
            .softmax(-1, Kind::Float);
        let y = att.matmul(&v).transpose(1, 2).contiguous().view([n, t, d]);
        b.attn_proj.forward(&y)
    }

    fn forward(&self, idx: &Tensor) -> Tensor {
        let t = idx.size()[1];
        let pos = Tensor::arange(t, (Kind::Int64, Device::Cpu));
        let mut h = self.tok_emb.forward(idx) + self.pos_emb.forward(&pos);
        for b in &self.blocks {
            h = &h + Self::attention(b, &b.ln1.forward(&h));
            let m = b.fc.forward(&b.ln2.forward(&h)).gelu("none");
            h = &h + b.mlp_proj.forward(&m);
        }
        self.head.forward(&self.ln_f.forward(&h))
    }

    /// Mean next-token cross-entropy over `tokens` (`[batch, CONTEXT + 1]`).
    fn loss(&self, tokens: &Tensor) -> Tensor {
        let input = tokens.narrow(1, 0, CONTEXT);
        let target = tokens.narrow(1, 1, CONTEXT);
        self.forward(&input)
            .view([-1, VOCAB])
            .cross_entropy_for_logits(&target.reshape([-1]))
    }
}

// ---------------------------------------------------------------------------------------------
// Synthetic data

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Sequence `index` of the global batch of `step`: a Markov chain where token `t` is followed
/// by `(5t + 3) mod 64` with probability 3/4 and by a uniformly random token otherwise. A pure
/// function of `(step, index)`, so every world size sees the same global batch, and a resumed
/// run continues the data stream at its step count.
fn sequence(step: usize, index: usize) -> Vec<i64> {
    let mut s = DATA_SEED ^ ((step as u64) << 32) ^ index as u64;
    let mut tok = (splitmix64(&mut s) % VOCAB as u64) as i64;
    let mut out = vec![tok];
    for _ in 0..CONTEXT {
        let r = splitmix64(&mut s);
        tok = if r % 4 != 0 {
            (5 * tok + 3) % VOCAB
        } else {
            ((r >> 8) % VOCAB as u64) as i64
        };
        out.push(tok);
    }
    out
}

/// This rank's slice of the global batch of `step`, `[GLOBAL_BATCH / world_size, CONTEXT + 1]`.
fn local_batch(step: usize, rank: usize, world_size: usize) -> Tensor {
    let per_rank = GLOBAL_BATCH / world_size;
    let tokens: Vec<i64> = (rank * per_rank..(rank + 1) * per_rank)
        .flat_map(|i| sequence(step, i))
        .collect();
    Tensor::from_slice(&tokens).view([per_rank as i64, CONTEXT + 1])
}

// ---------------------------------------------------------------------------------------------
// FSDP training on one rank

/// What an optimizer slot is: a flat parameter (by index in the layout) or an unmanaged
/// parameter kept whole on every rank (by model index).
#[derive(Clone, Copy)]
enum Slot {
    Flat(usize),
    Whole(usize),
}

/// One rank: its model replica (whose parameters are overwritten from the shards before every
/// forward pass), its FSDP layout, parameter shards and sharded Adam.
struct Rank {
    fsdp: Fsdp,
    gpt: Gpt,
    /// This rank's `VarStore` variables in model order (`fsdp.layout().model().params`).
    vars: Vec<Tensor>,
    params: OptimParams,
    /// Per optimizer id: what it is.
    slots: Vec<Slot>,
    /// Per optimizer id: this rank's tensor (a flat shard, or a whole unmanaged parameter).
    shards: Vec<HostTensor>,
    adam: Adam,
    /// Optimizer steps taken (the data position).
    step: usize,
}

/// Serializes the deterministic initialization: `tch::manual_seed` seeds one process-wide
/// generator, which thread ranks share.
static INIT: Mutex<()> = Mutex::new(());

/// Builds the model with identical initial values on every rank: the model, its description
/// and its `VarStore` variables in model order ([`Gpt::param_order`]).
fn build_model() -> BoxResult<(Gpt, ModelDesc, Vec<Tensor>)> {
    let vs = nn::VarStore::new(Device::Cpu);
    let gpt = {
        let _seeded = INIT.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(INIT_SEED);
        Gpt::new(&vs.root())
    };
    let order = Gpt::param_order();
    let model = model_desc_from_var_store_in_order(&vs, &order)?;
    let vars: Vec<Tensor> = var_store_params_in_order(&vs, &order)?
        .params
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    Ok((gpt, model, vars))
}

impl Rank {
    /// Builds the model (identical initial values on every rank), wraps it with `policy` over
    /// `pg` and cuts this rank's shards of the initial values.
    fn new(pg: Arc<dyn ProcessGroup>, policy: &WrapPolicy) -> BoxResult<Rank> {
        let (gpt, model, vars) = build_model()?;
        let fsdp = Fsdp::new(&model, policy, pg)?;
        let params = fsdp.optim_params();
        let slots = params
            .iter()
            .map(|(_, p)| -> BoxResult<Slot> {
                let layout = fsdp.layout();
                Ok(match p {
                    OptimParam::Flat(unit) => Slot::Flat(
                        layout
                            .flat_of_unit(unit)
                            .ok_or_else(|| format!("no flat parameter for unit `{unit}`"))?
                            .index,
                    ),
                    OptimParam::Param(name) => Slot::Whole(
                        layout
                            .param_index(name)
                            .ok_or_else(|| format!("no parameter `{name}`"))?,
                    ),
                })
            })
            .collect::<BoxResult<Vec<_>>>()?;
        let full = vars
            .iter()
            .map(|t| Ok(Some(to_host(t)?)))
            .collect::<BoxResult<Vec<_>>>()?;
        let shards = shard_tensors(fsdp.layout(), fsdp.rank(), &params, &full)?
            .into_iter()
            .map(|t| t.ok_or("every parameter has an initial value"))
            .collect::<Result<Vec<_>, _>>()?;
        let adam = Adam::new(
            params.clone(),
            AdamConfig {
                lr: LR,
                ..Default::default()
            },
        )?;
        Ok(Rank {
            fsdp,
            gpt,
            vars,
            params,
            slots,
            shards,
            adam,
            step: 0,
        })
    }

    fn pg(&self) -> &dyn ProcessGroup {
        self.fsdp.process_group().as_ref()
    }

    /// All-gathers every flat parameter and writes its members into the model's variables.
    fn gather_params(&self) -> BoxResult<()> {
        let layout = self.fsdp.layout();
        for (slot, shard) in self.slots.iter().zip(&self.shards) {
            match *slot {
                Slot::Flat(f) => {
                    let fl = &layout.flat_params()[f];
                    let mut full = HostTensor::zeros(fl.dtype, &[fl.padded_numel()]);
                    self.pg()
                        .all_gather_into(shard.as_bytes(), full.bytes_mut())?;
                    for (m, view) in fl.members.iter().zip(unflatten_full(fl, &full)?) {
                        write_var(&self.vars[m.param_index], &view)?;
                    }
                }
                Slot::Whole(p) => write_var(&self.vars[p], shard)?,
            }
        }
        Ok(())
    }

    /// This rank's averaged gradient per optimizer slot: flat gradients reduce-scattered,
    /// unmanaged ones all-reduced.
    fn reduce_grads(&self) -> BoxResult<Vec<Option<HostTensor>>> {
        let layout = self.fsdp.layout();
        self.slots
            .iter()
            .map(|slot| match *slot {
                Slot::Flat(f) => {
                    let fl = &layout.flat_params()[f];
                    let grads = fl
                        .members
                        .iter()
                        .map(|m| grad_host(&self.vars[m.param_index]))
                        .collect::<BoxResult<Vec<_>>>()?;
                    let send = flatten_padded(fl, &grads)?;
                    let mut mine = HostTensor::zeros(fl.dtype, &[fl.shard_numel()]);
                    self.pg().reduce_scatter_into(
                        send.as_bytes(),
                        mine.bytes_mut(),
                        fl.dtype,
                        ReduceOp::Avg,
                    )?;
                    Ok(Some(mine))
                }
                Slot::Whole(p) => {
                    let mut g = grad_host(&self.vars[p])?;
                    let dtype = g.dtype();
                    self.pg().all_reduce(g.bytes_mut(), dtype, ReduceOp::Avg)?;
                    Ok(Some(g))
                }
            })
            .collect()
    }
}

/// One rank's training loop body, FSDP1 ([`Rank`]) or FSDP2 ([`fsdp2::Rank2`]).
trait Trainer {
    /// Optimizer steps taken (the data position).
    fn step(&self) -> usize;

    /// One training step; returns the global mean loss (before the update).
    fn train_step(&mut self) -> BoxResult<f64>;

    /// Saves the checkpoint into `dir`. Collective.
    fn save(&self, dir: &Path) -> BoxResult<()>;

    /// Loads the checkpoint in `dir` (saved at any world size and wrapping) and the step
    /// count. Collective.
    fn load(&mut self, dir: &Path) -> BoxResult<()>;
}

impl Trainer for Rank {
    fn step(&self) -> usize {
        self.step
    }

    fn train_step(&mut self) -> BoxResult<f64> {
        self.gather_params()?;
        let batch = local_batch(self.step, self.fsdp.rank(), self.fsdp.world_size());
        let loss = forward_backward(&self.gpt, &mut self.vars, &batch)?;
        let grads = self.reduce_grads()?;
        self.adam.step(&mut self.shards, &grads)?;
        self.step += 1;
        global_mean(self.pg(), loss)
    }

    /// Saves the sharded checkpoint: Adam's state and this rank's parameter shards.
    /// Collective.
    fn save(&self, dir: &Path) -> BoxResult<()> {
        let model: Vec<Option<HostTensor>> = self.shards.iter().cloned().map(Some).collect();
        self.fsdp.save_checkpoint(
            &self.adam.state_dict(),
            &self.params,
            &model,
            dir,
            &SaveOptions::default(),
        )?;
        Ok(())
    }

    /// Loads Adam's state, this rank's parameter shards (both for this rank's layout, whatever
    /// the world size and wrapping of the save) and the step count from the checkpoint.
    fn load(&mut self, dir: &Path) -> BoxResult<()> {
        let opts = LoadOptions::default();
        let osd: OptimStateDict<HostTensor> =
            self.fsdp.load_optim_checkpoint(dir, &self.params, &opts)?;
        let model: Vec<Option<HostTensor>> = self.fsdp.load_model_params(dir, &opts)?;
        if model.len() != self.shards.len() {
            return Err(format!(
                "the checkpoint gives {} parameter tensors, the optimizer has {}",
                model.len(),
                self.shards.len()
            )
            .into());
        }
        for (id, t) in model.into_iter().enumerate() {
            self.shards[id] =
                t.ok_or_else(|| format!("the checkpoint holds no value of parameter {id}"))?;
        }
        self.step = optimizer_step(&osd)?;
        self.adam.load_state_dict(&osd)?;
        Ok(())
    }
}

/// Zeroes the model's gradients, then runs forward and backward on `batch`; returns the mean
/// loss (before the update).
fn forward_backward(gpt: &Gpt, vars: &mut [Tensor], batch: &Tensor) -> BoxResult<f64> {
    for v in vars.iter_mut() {
        v.zero_grad();
    }
    let loss = gpt.loss(batch);
    loss.backward();
    Ok(f64::try_from(&loss)?)
}

/// The mean of every rank's `local` loss: the global mean loss (equal micro-batches on every
/// rank). Collective.
fn global_mean(pg: &dyn ProcessGroup, local: f64) -> BoxResult<f64> {
    let mut global = local.to_ne_bytes();
    pg.all_reduce(&mut global, DType::F64, ReduceOp::Avg)?;
    Ok(f64::from_ne_bytes(global))
}

/// Adam's `step`, the same for every parameter: the number of steps taken.
fn optimizer_step(osd: &OptimStateDict<HostTensor>) -> BoxResult<usize> {
    let step = osd
        .state
        .values()
        .find_map(|st| st.get("step").and_then(Value::as_tensor))
        .and_then(HostTensor::item)
        .ok_or("the checkpoint holds no Adam `step`")?;
    Ok(step as usize)
}

fn to_host(t: &Tensor) -> BoxResult<HostTensor> {
    Ok(TchTensor::new(t.shallow_clone())?.to_host_tensor()?)
}

/// A variable's gradient on the host (zeros when backward left none).
fn grad_host(var: &Tensor) -> BoxResult<HostTensor> {
    let g = var.grad();
    if g.defined() {
        to_host(&g)
    } else {
        let shape: Vec<usize> = var.size().iter().map(|&d| d as usize).collect();
        Ok(HostTensor::zeros(DType::F32, &shape))
    }
}

/// Copies `value` into a model variable in place (no autograd record).
fn write_var(var: &Tensor, value: &HostTensor) -> BoxResult<()> {
    let src = TchTensor::from_host_tensor(value)?.into_tch();
    let mut dst = var.shallow_clone();
    tch::no_grad(|| dst.f_copy_(&src))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Phases

/// What one rank does.
#[derive(Clone, Debug)]
enum Phase {
    /// Train `steps` steps from the initial values wrapped by the generation's train policy
    /// ([`train_policy`], [`fsdp2::train_policy`]), saving a checkpoint into `ckpt` after step
    /// `save_at`.
    Train {
        steps: usize,
        save_at: usize,
        ckpt: PathBuf,
    },
    /// Load the checkpoint in `ckpt` wrapped by the generation's resume policy
    /// ([`resume_policy`], [`fsdp2::resume_policy`]) and train up to step `steps`.
    Resume { steps: usize, ckpt: PathBuf },
}

/// The per-rank body, the same on thread ranks and one process per rank: returns
/// `(step, global loss)` for every step it trained (steps count from 1).
fn run_rank(pg: Arc<dyn ProcessGroup>, phase: &Phase, generation: Generation) -> BoxResult<Curve> {
    let mut curve = Vec::new();
    match phase {
        Phase::Train {
            steps,
            save_at,
            ckpt,
        } => {
            let mut rank = generation.trainer(pg, &generation.train_policy())?;
            for _ in 0..*steps {
                let loss = rank.train_step()?;
                curve.push((rank.step(), loss));
                if rank.step() == *save_at {
                    rank.save(ckpt)?;
                }
            }
        }
        Phase::Resume { steps, ckpt } => {
            let mut rank = generation.trainer(pg, &generation.resume_policy())?;
            rank.load(ckpt)?;
            while rank.step() < *steps {
                let loss = rank.train_step()?;
                curve.push((rank.step(), loss));
            }
        }
    }
    Ok(curve)
}

/// Which FSDP the example trains with (`--fsdp 1` or `--fsdp 2`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Generation {
    /// `FullyShardedDataParallel`: flat parameters, a sharded checkpoint of the crate's format.
    Fsdp1,
    /// `fully_shard`: per-parameter dim-0 shards, a DCP checkpoint PyTorch loads.
    Fsdp2,
}

impl Generation {
    fn parse(s: &str) -> BoxResult<Generation> {
        match s {
            "1" => Ok(Generation::Fsdp1),
            "2" => Ok(Generation::Fsdp2),
            other => Err(format!("--fsdp takes 1 or 2, not `{other}`").into()),
        }
    }

    fn version(self) -> u8 {
        match self {
            Generation::Fsdp1 => 1,
            Generation::Fsdp2 => 2,
        }
    }

    fn train_policy(self) -> WrapPolicy {
        match self {
            Generation::Fsdp1 => train_policy(),
            Generation::Fsdp2 => fsdp2::train_policy(),
        }
    }

    fn resume_policy(self) -> WrapPolicy {
        match self {
            Generation::Fsdp1 => resume_policy(),
            Generation::Fsdp2 => fsdp2::resume_policy(),
        }
    }

    /// A rank wrapped with `policy`, at its initial values.
    fn trainer(
        self,
        pg: Arc<dyn ProcessGroup>,
        policy: &WrapPolicy,
    ) -> BoxResult<Box<dyn Trainer>> {
        Ok(match self {
            Generation::Fsdp1 => Box::new(Rank::new(pg, policy)?),
            Generation::Fsdp2 => Box::new(fsdp2::Rank2::new(pg, policy)?),
        })
    }
}

/// The process group when a launcher started one process per rank; `None` means "use thread
/// ranks in this process".
///
/// With the `mpi` feature, a process started by `mpirun` (which sets `OMPI_COMM_WORLD_SIZE`
/// for Open MPI, `PMI_SIZE` for MPICH's Hydra) is one rank of `MPI_COMM_WORLD`. This is the one
/// place that chooses the backend; NCCL (one process per GPU) would go here too.
fn launcher_world() -> BoxResult<Option<Arc<dyn ProcessGroup>>> {
    #[cfg(feature = "mpi")]
    {
        let launched = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        if launched {
            let world = fsdp::collectives::MpiProcessGroup::world()?;
            return Ok(Some(Arc::new(world)));
        }
    }
    Ok(None)
}

/// What [`run_phase`] returns.
struct PhaseResult {
    /// This process's curve (rank 0's for thread ranks; every rank computes the same global
    /// losses).
    curve: Curve,
    /// Whether this process is rank 0 (always, for thread ranks).
    rank0: bool,
    world_size: usize,
}

/// Runs `phase` on every rank: in this process as one rank of the launcher's group, or on
/// `threads` thread ranks.
fn run_phase(phase: &Phase, threads: usize, generation: Generation) -> BoxResult<PhaseResult> {
    if let Some(world) = launcher_world()? {
        let (rank0, world_size) = (world.rank() == 0, world.world_size());
        let curve = run_rank(world, phase, generation)?;
        return Ok(PhaseResult {
            curve,
            rank0,
            world_size,
        });
    }
    if threads == 0 || GLOBAL_BATCH % threads != 0 {
        return Err(
            format!("the world size must divide the global batch of {GLOBAL_BATCH}").into(),
        );
    }
    let mut curves = ThreadGroup::run(threads, |pg| run_rank(Arc::new(pg), phase, generation))
        .into_iter()
        .collect::<BoxResult<Vec<_>>>()?;
    Ok(PhaseResult {
        curve: curves.swap_remove(0),
        rank0: true,
        world_size: threads,
    })
}

// ---------------------------------------------------------------------------------------------
// Curves

/// Writes the training run's curve as JSON: `world_size`, `fsdp_version` and `losses`
/// (`[step, loss]` pairs), plus the fields of `extra` (an object) if given.
fn write_curve(
    path: &Path,
    world_size: usize,
    generation: Generation,
    curve: &[(usize, f64)],
    extra: Option<serde_json::Value>,
) -> BoxResult<()> {
    let mut json = serde_json::json!({
        "world_size": world_size,
        "fsdp_version": generation.version(),
        "losses": curve,
    });
    if let (Some(obj), Some(serde_json::Value::Object(more))) = (json.as_object_mut(), extra) {
        obj.extend(more);
    }
    std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    Ok(())
}

/// What `examples/train_resume_torch.py` needs to continue an FSDP2 run in PyTorch from the
/// checkpoint after step `save_at`: the model's sizes, the optimizer's learning rate, the
/// modules to apply `fully_shard` to (those of [`fsdp2::resume_policy`], in order), and the
/// global batch of every step after the checkpoint (`batches[i]`: `step` as the curve counts
/// it, from 1, and its `GLOBAL_BATCH` sequences, of which rank `r` of `ws` takes sequences
/// `r * GLOBAL_BATCH / ws ..`, as [`local_batch`] does). The batches are written out rather
/// than regenerated in Python so that both sides train on the same tokens by construction.
fn torch_continuation(save_at: usize, steps: usize) -> serde_json::Value {
    let batches: Vec<serde_json::Value> = (save_at + 1..=steps)
        .map(|step| {
            // Curve step `step` trains on the data of step index `step - 1` (see `train_step`).
            let sequences: Vec<Vec<i64>> =
                (0..GLOBAL_BATCH).map(|i| sequence(step - 1, i)).collect();
            serde_json::json!({ "step": step, "sequences": sequences })
        })
        .collect();
    serde_json::json!({
        "save_at": save_at,
        "global_batch": GLOBAL_BATCH,
        "lr": LR,
        "model": {
            "vocab": VOCAB,
            "d_model": D_MODEL,
            "heads": HEADS,
            "context": CONTEXT,
            "layers": LAYERS,
        },
        "fully_shard": fsdp2::resume_policy().units,
        "batches": batches,
    })
}

/// The world size, FSDP generation and curve [`write_curve`] wrote.
fn read_curve(path: &Path) -> BoxResult<(usize, Generation, Curve)> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)?;
    let version = json["fsdp_version"].as_u64().unwrap_or(1);
    Ok((
        serde_json::from_value(json["world_size"].clone())?,
        Generation::parse(&version.to_string())?,
        serde_json::from_value(json["losses"].clone())?,
    ))
}

/// Prints both curves side by side and fails unless the resumed run trained exactly the
/// uninterrupted run's steps after its checkpoint, each loss within [`REL_TOL`].
fn compare(
    uninterrupted: &[(usize, f64)],
    resumed: &[(usize, f64)],
    ws: (usize, usize),
) -> BoxResult<()> {
    println!(
        "{:>4}  {:>22}  {:>22}  {:>10}",
        "step",
        format!("uninterrupted (ws {})", ws.0),
        format!("resumed (ws {})", ws.1),
        "rel diff"
    );
    let mut worst: f64 = 0.0;
    for &(step, loss) in uninterrupted {
        match resumed.iter().find(|(s, _)| *s == step) {
            Some(&(_, r)) => {
                let rel = (r - loss).abs() / loss.abs();
                // NaN sticks (f64::max would drop it).
                if rel.is_nan() || rel > worst {
                    worst = rel;
                }
                println!("{step:>4}  {loss:>22.9}  {r:>22.9}  {rel:>10.2e}");
            }
            None => println!("{step:>4}  {loss:>22.9}  {:>22}  {:>10}", "-", "-"),
        }
    }
    let first = resumed
        .first()
        .map(|r| r.0)
        .ok_or("the resumed run trained no step")?;
    let expected: Vec<usize> = uninterrupted
        .iter()
        .map(|c| c.0)
        .filter(|&s| s >= first)
        .collect();
    let got: Vec<usize> = resumed.iter().map(|c| c.0).collect();
    if got != expected {
        return Err(format!("the resumed run trained steps {got:?}, expected {expected:?}").into());
    }
    println!(
        "resumed from the checkpoint after step {}: {} steps compared, max relative difference \
         {worst:.3e} (tolerance {REL_TOL:e})",
        first - 1,
        got.len()
    );
    if worst.is_nan() || worst > REL_TOL {
        return Err(format!(
            "resume check FAILED: resumed losses differ from the uninterrupted run by up to \
             {worst:.3e} (tolerance {REL_TOL:e})"
        )
        .into());
    }
    println!("resume check passed");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Command line

struct Args {
    phase: Option<String>,
    ckpt: Option<PathBuf>,
    curve: Option<PathBuf>,
    world_size: Option<usize>,
    steps: usize,
    save_at: usize,
    generation: Generation,
}

fn parse_args() -> BoxResult<Args> {
    let mut args = Args {
        phase: None,
        ckpt: None,
        curve: None,
        world_size: None,
        steps: DEFAULT_STEPS,
        save_at: DEFAULT_SAVE_AT,
        generation: Generation::Fsdp1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--phase" => args.phase = Some(value()?),
            "--ckpt" => args.ckpt = Some(value()?.into()),
            "--curve" => args.curve = Some(value()?.into()),
            "--world-size" => args.world_size = Some(value()?.parse()?),
            "--steps" => args.steps = value()?.parse()?,
            "--save-at" => args.save_at = value()?.parse()?,
            "--fsdp" => args.generation = Generation::parse(&value()?)?,
            "-h" | "--help" => {
                println!(
                    "usage: train_resume [--phase train|resume --ckpt DIR --curve FILE] \
                     [--world-size N] [--steps N] [--save-at K] [--fsdp 1|2]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument `{other}` (try --help)").into()),
        }
    }
    if args.save_at == 0 || args.save_at >= args.steps {
        return Err(format!(
            "--save-at ({}) must be between 1 and --steps - 1 ({})",
            args.save_at,
            args.steps - 1
        )
        .into());
    }
    Ok(args)
}

fn main() -> BoxResult<()> {
    let args = parse_args()?;
    // One libtorch thread per rank: the ranks are the parallelism, and results do not depend
    // on the machine's core count.
    tch::set_num_threads(1);
    let start = Instant::now();
    let need = |v: &Option<PathBuf>, what: &str| -> BoxResult<PathBuf> {
        v.clone()
            .ok_or_else(|| format!("--phase needs {what}").into())
    };
    // Under a launcher only rank 0 prints.
    let print_done = match args.phase.as_deref() {
        None => {
            // Everything in this process on thread ranks.
            let tmp = tempfile::tempdir()?;
            let ckpt = args.ckpt.clone().unwrap_or_else(|| tmp.path().join("ckpt"));
            let (train_ws, resume_ws) = (args.world_size.unwrap_or(4), 2);
            let generation = args.generation;
            println!(
                "FSDP{}: training {} steps on {train_ws} thread ranks (units {:?}), checkpoint \
                 after step {}",
                generation.version(),
                args.steps,
                generation.train_policy().units,
                args.save_at
            );
            let train = Phase::Train {
                steps: args.steps,
                save_at: args.save_at,
                ckpt: ckpt.clone(),
            };
            let uninterrupted = run_phase(&train, train_ws, generation)?.curve;
            let p = generation.resume_policy();
            println!(
                "resuming on {resume_ws} thread ranks (units {:?}, ignored {:?})",
                p.units, p.ignored_modules
            );
            let resume = Phase::Resume {
                steps: args.steps,
                ckpt,
            };
            let resumed = run_phase(&resume, resume_ws, generation)?.curve;
            compare(&uninterrupted, &resumed, (train_ws, resume_ws))?;
            true
        }
        Some("train") => {
            let ckpt = need(&args.ckpt, "--ckpt DIR")?;
            let curve_file = need(&args.curve, "--curve FILE")?;
            let ws = args.world_size.unwrap_or(4);
            let phase = Phase::Train {
                steps: args.steps,
                save_at: args.save_at,
                ckpt,
            };
            let done = run_phase(&phase, ws, args.generation)?;
            if done.rank0 {
                let extra = (args.generation == Generation::Fsdp2)
                    .then(|| torch_continuation(args.save_at, args.steps));
                write_curve(
                    &curve_file,
                    done.world_size,
                    args.generation,
                    &done.curve,
                    extra,
                )?;
                for (step, loss) in &done.curve {
                    println!("step {step:>3}  loss {loss:.9}");
                }
            }
            done.rank0
        }
        Some("resume") => {
            let ckpt = need(&args.ckpt, "--ckpt DIR")?;
            let curve_file = need(&args.curve, "--curve FILE")?;
            let ws = args.world_size.unwrap_or(2);
            let (train_ws, trained_with, uninterrupted) = read_curve(&curve_file)?;
            if trained_with != args.generation {
                return Err(format!(
                    "{} was trained with --fsdp {}; resume it with the same",
                    curve_file.display(),
                    trained_with.version()
                )
                .into());
            }
            let phase = Phase::Resume {
                steps: uninterrupted.last().map_or(0, |c| c.0),
                ckpt,
            };
            let done = run_phase(&phase, ws, args.generation)?;
            if done.rank0 {
                compare(&uninterrupted, &done.curve, (train_ws, done.world_size))?;
            }
            done.rank0
        }
        Some(other) => return Err(format!("unknown phase `{other}` (train or resume)").into()),
    };
    if print_done {
        println!("done in {:.1} s", start.elapsed().as_secs_f64());
    }
    Ok(())
}

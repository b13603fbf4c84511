//! `consolidate IN OUT`, `consolidate-sharded RANK… -o FULL` and `consolidate-torch --model
//! DESC RANK… -o FULL`: one full state dict of a sharded checkpoint.

use super::conversions;
use super::{
    clean_stale, expect_input, load_optim, load_spec, on_processes, phase, save_optim, step, Input,
    Progress, TorchOptions, Unit, Written,
};
use crate::checkpoint;
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::commands::rank_dicts::{check_local_dicts, check_rank_files, consolidate_local_dicts};
use crate::error::{Error, Result};
use crate::io::dcp;
use crate::io::{self, FileFormat};
use crate::optim_state::OptimStateDict;
use crate::storage;
use std::path::{Path, PathBuf};

/// Reads every rank's optimizer state dict, in order, as one counted phase.
fn read_rank_files(p: &dyn Progress, ranks: &[PathBuf]) -> Result<Vec<OptimStateDict>> {
    p.start(
        "reading rank files",
        Some((ranks.len() as u64, Unit::Files)),
    );
    let mut dicts = Vec::with_capacity(ranks.len());
    for (i, r) in ranks.iter().enumerate() {
        match load_optim(r) {
            Ok(d) => dicts.push(d),
            Err(e) => {
                p.finish();
                return Err(e);
            }
        }
        p.update(i as u64 + 1);
    }
    p.finish();
    Ok(dicts)
}

/// Options of [`consolidate_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsolidateOptions {
    /// `--optim`: for a DeepSpeed checkpoint, write `{"model": …, "optim": …}` (the fp32
    /// weights and Adam's state, named as `get_state_dict(full_state_dict=True)` names them)
    /// instead of the fp32 weights alone. Refused for other inputs, whose consolidation holds
    /// whatever they saved.
    pub optim: bool,
}

/// `consolidate IN OUT`: the full optimizer state dict of the crate's checkpoint directory,
/// the whole state of a DCP directory (what `dcp_to_torch_save` writes), or the fp32 weights
/// of a DeepSpeed checkpoint (what `get_fp32_state_dict_from_zero_checkpoint` returns),
/// streamed to `.safetensors` or `.pt` with bounded memory.
///
/// Run by the processes of `pg` (`&Solo` for one; under `mpirun -np N`, see
/// [`consolidate_splits`]): each writes its share of the file's byte ranges
/// ([`conversions::checkpoint_to_safetensors`], [`conversions::checkpoint_to_torch_save`],
/// [`conversions::dcp_to_safetensors`], [`conversions::dcp_to_torch_save`]) and process 0 installs
/// it. The file is the same for any number of processes; a failure on any process fails all
/// of them with the same error and leaves `out` as it was. `p` reports this process's share.
pub fn consolidate(
    input: &Path,
    out: &Path,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    consolidate_with(input, out, &ConsolidateOptions::default(), pg, p)
}

/// [`consolidate`] with options: `--optim` for a DeepSpeed checkpoint
/// ([`conversions::deepspeed_to_torch_save`], [`conversions::deepspeed_to_safetensors`]).
pub fn consolidate_with(
    input: &Path,
    out: &Path,
    opts: &ConsolidateOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let format = FileFormat::from_path(out)?;
    let found = pg.agree(consolidate_input(input))?;
    if opts.optim && found == Input::Megatron {
        return Err(Error::Unsupported(format!(
            "consolidate --optim of a Megatron-Core checkpoint is not supported yet (`{}`): this version writes its model tensors (consolidate without --optim); `inspect` shows its optimizer layout",
            input.display()
        )));
    }
    if opts.optim && !found.is_deepspeed() {
        return Err(Error::Unsupported(format!(
            "consolidate --optim takes a DeepSpeed checkpoint (its optimizer state is kept apart from the weights); `{}` is {}, whose consolidation already holds all it saved: drop --optim",
            input.display(),
            found.describe()
        )));
    }
    pg.on_root(|| {
        storage::check_not_overlapping(out, &[input])?;
        storage::check_file_output(out)
    })?;
    if found.is_deepspeed() {
        return consolidate_deepspeed(input, out, format, opts, pg, p);
    }
    // What the file is made of, by input form: its tensor bytes, the job that writes it, and
    // how the report names the input and what was written.
    let (total, what, noun) = match found {
        Input::Megatron => (
            pg.agree(io::megatron::MegatronCheckpoint::open(input).map(|m| m.model_bytes()))?,
            "Megatron-Core checkpoint ",
            "model tensors",
        ),
        i if i.is_dcp() => (
            pg.agree(dcp::summary(input).map(|s| s.tensor_bytes))?,
            "DCP checkpoint ",
            "tensors",
        ),
        _ => (
            pg.agree(checkpoint::read_manifest(input).map(|m| m.tensor_bytes()))?,
            "",
            "tensor state",
        ),
    };
    pg.on_root(|| clean_stale(p, out, None))?;
    let share_total = (pg.world_size() == 1).then_some((total, Unit::Bytes));
    p.start(&phase("consolidating", pg), share_total);
    let to = |b| p.update(b);
    let safetensors = format == FileFormat::Safetensors;
    let written = match found {
        Input::Megatron if safetensors => conversions::megatron_to_safetensors(input, out, pg, to),
        Input::Megatron => conversions::megatron_to_torch_save(input, out, pg, to),
        i if i.is_dcp() && safetensors => conversions::dcp_to_safetensors(input, out, pg, to),
        i if i.is_dcp() => conversions::dcp_to_torch_save(input, out, pg, to),
        _ if safetensors => conversions::checkpoint_to_safetensors(input, out, pg, to),
        _ => conversions::checkpoint_to_torch_save(input, out, pg, to),
    };
    p.finish();
    let written = written?;
    Ok(Written {
        operation: "consolidate",
        output: out.to_path_buf(),
        tensor_bytes: written,
        count: None,
        world_size: None,
        message: format!(
            "consolidated {what}{} -> {}{}: {written} bytes of {noun}",
            input.display(),
            out.display(),
            on_processes(pg),
        ),
    })
}

/// `consolidate DS_DIR OUT [--optim]`: the fp32 weights of a DeepSpeed checkpoint, or with
/// `--optim` the weights and Adam's state, streamed one parameter at a time.
fn consolidate_deepspeed(
    input: &Path,
    out: &Path,
    format: FileFormat,
    opts: &ConsolidateOptions,
    pg: &dyn ProcessGroup,
    p: &dyn Progress,
) -> Result<Written> {
    let ckpt = pg.agree(step(p, &format!("reading {}", input.display()), || {
        io::deepspeed::DeepSpeedCheckpoint::open(input)
    }))?;
    pg.on_root(|| clean_stale(p, out, None))?;
    let states = if opts.optim { 3 } else { 1 };
    let total = ckpt.fp32_bytes() * states;
    let share_total = (pg.world_size() == 1).then_some((total, Unit::Bytes));
    p.start(&phase("consolidating", pg), share_total);
    let what = conversions::DeepSpeedOutput { optim: opts.optim };
    let to = |b| p.update(b);
    let written = match format {
        FileFormat::Safetensors => conversions::deepspeed_to_safetensors(input, out, what, pg, to),
        FileFormat::TorchSave => conversions::deepspeed_to_torch_save(input, out, what, pg, to),
    };
    p.finish();
    let written = written?;
    Ok(Written {
        operation: "consolidate",
        output: out.to_path_buf(),
        tensor_bytes: written,
        count: Some(ckpt.params().len()),
        world_size: Some(ckpt.world_size()),
        message: format!(
            "consolidated DeepSpeed ZeRO-{} checkpoint {} (tag {}, {} ranks) -> {}{}: {} parameters, {written} bytes of {}",
            ckpt.stage(),
            input.display(),
            ckpt.tag(),
            ckpt.world_size(),
            out.display(),
            on_processes(pg),
            ckpt.params().len(),
            if opts.optim { "weights and Adam state" } else { "fp32 weights" }
        ),
    })
}

/// The input of `consolidate`: a DCP directory, a checkpoint of this crate, a DeepSpeed
/// checkpoint or a Megatron-Core checkpoint.
fn consolidate_input(input: &Path) -> Result<Input> {
    expect_input(
        "consolidate",
        input,
        "a DCP directory, a checkpoint of this crate, a DeepSpeed checkpoint or a Megatron-Core checkpoint",
        |i| i.is_dcp() || i == Input::Checkpoint || i.is_deepspeed() || i == Input::Megatron,
    )
}

/// Whether `consolidate INPUT OUTPUT` splits its work across the processes of a job: from
/// the crate's checkpoint directory, a DCP directory or a DeepSpeed checkpoint to either
/// format (files whose layout is known before any byte is written), that is whenever
/// `OUTPUT`'s format is known.
pub fn consolidate_splits(out: &Path) -> bool {
    FileFormat::from_path(out).is_ok()
}

/// `consolidate-sharded RANK… -o FULL`: per-rank SHARDED dicts (FSDP1 `ShardedTensor`, FSDP2
/// `DTensor`) into the full dict.
pub fn consolidate_sharded(ranks: &[PathBuf], output: &Path, p: &dyn Progress) -> Result<Written> {
    FileFormat::from_path(output)?;
    let inputs: Vec<&Path> = ranks.iter().map(PathBuf::as_path).collect();
    storage::check_not_overlapping(output, &inputs)?;
    storage::check_file_output(output)?;
    let dicts = read_rank_files(p, ranks)?;
    let full = crate::commands::rank_dicts::consolidate_sharded(&dicts)?;
    drop(dicts);
    write_full(
        p,
        &full,
        output,
        ranks.len(),
        "consolidate_sharded",
        "sharded ranks",
    )
}

/// Writes a consolidated dict of `ranks` ranks to `output`; the report of `operation`.
fn write_full(
    p: &dyn Progress,
    full: &OptimStateDict,
    output: &Path,
    ranks: usize,
    operation: &'static str,
    what: &str,
) -> Result<Written> {
    clean_stale(p, output, None)?;
    step(p, &format!("writing {}", output.display()), || {
        save_optim(full, output)
    })?;
    Ok(Written {
        operation,
        output: output.to_path_buf(),
        tensor_bytes: full.tensor_bytes() as u64,
        count: Some(full.state.len()),
        world_size: Some(ranks),
        message: format!(
            "consolidated {ranks} {what} into {}: {} keys, {} bytes of tensor state",
            output.display(),
            full.state.len(),
            full.tensor_bytes()
        ),
    })
}

/// `consolidate-torch --model DESC RANK… -o FULL`: every rank's local `optim.state_dict()`
/// into the dict `FSDP.full_optim_state_dict` returns.
pub fn consolidate_torch(
    model: &Path,
    ranks: &[PathBuf],
    output: &Path,
    opts: &TorchOptions,
    p: &dyn Progress,
) -> Result<Written> {
    FileFormat::from_path(output)?;
    let mut inputs: Vec<&Path> = ranks.iter().map(PathBuf::as_path).collect();
    inputs.push(model);
    storage::check_not_overlapping(output, &inputs)?;
    storage::check_file_output(output)?;
    let spec = load_spec(model, opts.named_optimizer)?;
    // Fail on a model description that does not fit this world size before reading.
    spec.layout(ranks.len())?;
    let locals = read_rank_files(p, ranks)?;
    // Sizes first (their message names the world sizes that would fit), then the files.
    check_local_dicts(&spec, &locals)?;
    check_rank_files(ranks)?;
    let full = step(p, &format!("consolidating {} ranks", ranks.len()), || {
        consolidate_local_dicts(&spec, &locals)
    })?;
    drop(locals);
    write_full(p, &full, output, ranks.len(), "consolidate_torch", "ranks")
}

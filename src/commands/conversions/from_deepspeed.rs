//! A DeepSpeed checkpoint consolidated into one file (the fp32 weights
//! `get_fp32_state_dict_from_zero_checkpoint` returns, or with the optimizer state, the
//! `{"model", "optim"}` dict `get_state_dict(full_state_dict=True)` of the plain model names),
//! or written as a DCP directory that FSDP2 loads at any world size. Each parameter's tensors
//! are read from the ranks' partitions as they are written, one parameter at a time
//! ([`crate::io::deepspeed`]).

use super::coordinate::{write_dcp, write_planned_file, write_torch_save};
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::dcp::DcpWriteOptions;
use crate::io::deepspeed::{DeepSpeedCheckpoint, Streamed};
use crate::io::safetensors::LazyPlan;
use std::path::Path;

/// What [`deepspeed_to_torch_save`] and [`deepspeed_to_safetensors`] write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeepSpeedOutput {
    /// `false`: the dict `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`
    /// returns (buffers as float32, the fp32 master weights, tied aliases sharing their
    /// parameter's tensor, in that order). `true`: `{"model": …, "optim": {"state": …,
    /// "param_groups": …}}`, as `get_state_dict(model, optim,
    /// options=StateDictOptions(full_state_dict=True))` of the plain model and a
    /// `torch.optim.Adam` holding the run's state names it (`state` by parameter name, each
    /// `step`, `exp_avg`, `exp_avg_sq`; `params` lists names).
    pub optim: bool,
}

/// Writes the DeepSpeed checkpoint `src` (ZeRO stage 1, 2 or 3, or a universal checkpoint;
/// see [`DeepSpeedCheckpoint::open`]) to the `torch.save` file `dst` as `what` says, each
/// tensor streamed from the ranks' partitions into its place in the archive, every storage
/// read checked against its CRC-32 before the file is installed. Memory holds the pickles'
/// structure and a 1 MiB piece, whatever the model's size.
///
/// Run by the processes of `pg` (see [the module](super)), each streams its share of the
/// tensors; `progress` gets this process's tensor bytes written so far. Returns the tensor
/// bytes written by all.
pub fn deepspeed_to_torch_save(
    src: &Path,
    dst: &Path,
    what: DeepSpeedOutput,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = pg.agree(DeepSpeedCheckpoint::open(src))?;
    let cons = ckpt.consolidated(what.optim);
    let mut lazy = Streamed::new(&ckpt, &cons, dst, progress);
    write_torch_save(&cons.obj, dst, &mut lazy, pg)
}

/// [`deepspeed_to_torch_save`] to a `.safetensors` file in the crate's mapping
/// ([`crate::io::safetensors`]): for the fp32 weights, one tensor per name (a tied alias a
/// copy of its parameter's, safetensors having no aliasing), as `safetensors.torch.save_file`
/// of the dict with its aliases cloned.
pub fn deepspeed_to_safetensors(
    src: &Path,
    dst: &Path,
    what: DeepSpeedOutput,
    pg: &dyn ProcessGroup,
    progress: impl FnMut(u64),
) -> Result<u64> {
    let ckpt = pg.agree(DeepSpeedCheckpoint::open(src))?;
    let cons = ckpt.consolidated(what.optim);
    let mut lazy = Streamed::new(&ckpt, &cons, dst, progress);
    let plan = pg.agree(LazyPlan::new(&cons.obj, &dst.display().to_string(), &lazy))?;
    let me = (pg.rank(), pg.world_size());
    let written = write_planned_file(
        dst,
        plan.file_len(),
        pg,
        |file, tmp| plan.write_share(&mut lazy, (file, dst, tmp), me),
        |file, tmp, _| plan.write_header(file, dst, tmp),
    )?;
    Ok(written.iter().sum())
}

/// Writes the DeepSpeed checkpoint `src` (see [`DeepSpeedCheckpoint::open`]) as the DCP
/// directory `dst`, as `dcp.save({"model": msd, "optim": osd})` writes the state dicts that
/// `get_state_dict(model, optim)` gives of the plain model and its `torch.optim.Adam` holding
/// the run's state: keys `model.<name>` (the fp32 master weights, buffers in their own dtype,
/// tied aliases under both names) and `optim.state.<name>.{step,exp_avg,exp_avg_sq}`,
/// `optim.param_groups.<i>.<hyper-parameter>`. An FSDP2 (or FSDP1) model of the same
/// architecture at any world size loads it with `dcp.load` and `set_state_dict`, and training
/// continues from the DeepSpeed run's state.
///
/// Each tensor is streamed from the ranks' partitions into its place in the data file, every
/// storage read checked against its CRC-32 before the directory is installed; memory holds the
/// pickles' structure and a 1 MiB piece. Run by the processes of `pg` (see [the
/// module](super)), each writes its share of the tensors; process 0 writes `.metadata` and
/// installs the directory. `progress` gets this process's tensor bytes written so far.
/// Returns the tensor bytes written.
pub fn deepspeed_to_dcp(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    opts: &DcpWriteOptions,
    progress: impl FnMut(u64),
) -> Result<u64> {
    pg.agree(crate::storage::check_not_overlapping(dst, &[src]))?;
    let ckpt = pg.agree(DeepSpeedCheckpoint::open(src))?;
    let cons = ckpt.consolidated(true);
    let mut lazy = Streamed::new(&ckpt, &cons, dst, progress);
    write_dcp(&cons.obj, dst, &mut lazy, pg, opts)
}

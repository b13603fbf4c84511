//! The coordinator: runs an output's plan over a process group. Process 0 stages the
//! temporary output, every process writes its share of the bytes and syncs it, and once all
//! of them succeeded process 0 writes what is left and installs the output. A failure
//! anywhere fails every process with the lowest failing one's error, removes the temporary
//! and leaves the output path as it was.

use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::dcp::{Compression, DcpWriteOptions, PlannedDcp};
use crate::io::torch_save::writer::{LazyTensors, PlannedArchive};
use crate::io::torch_save::{self, PyObj};
use crate::storage::{create_planned_file, finish_planned_file, tmp_io_err};
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

/// One output file of `len` planned bytes written by every process of `pg` at once: each
/// runs `share` on the staged temporary (writing its own byte ranges; the temporary's path is
/// for messages), and process 0 runs `finish` with every process's report in rank order.
/// Returns the reports.
pub(crate) fn write_planned_file<T: serde::Serialize + serde::de::DeserializeOwned>(
    out: &Path,
    len: u64,
    pg: &dyn ProcessGroup,
    share: impl FnOnce(&File, &Path) -> Result<T>,
    finish: impl FnOnce(&File, &Path, &[T]) -> Result<()>,
) -> Result<Vec<T>> {
    let tmp = pg.on_root(|| create_planned_file(out, len))?;
    let open = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)
            .map_err(tmp_io_err("opening", out, &tmp))
    };
    let mine = open().and_then(|file| {
        let report = share(&file, &tmp)?;
        file.sync_all().map_err(tmp_io_err("syncing", out, &tmp))?;
        Ok(report)
    });
    let committed = pg.all_gather_agreed(mine).and_then(|all| {
        pg.on_root(|| {
            finish(&open()?, &tmp, &all)?;
            finish_planned_file(&tmp, out)
        })?;
        Ok(all)
    });
    if committed.is_err() && pg.rank() == 0 {
        let _ = std::fs::remove_file(&tmp);
    }
    committed
}

/// `obj` written as the `torch.save` file `path`, its placeholder tensors streamed by `lazy`:
/// the archive's layout is planned first, each process streams its share of the lazy
/// storages (about `1 / pg.world_size()` of their bytes) into their places, and process 0
/// writes the rest once it has every storage's CRC-32. The file is byte for byte what
/// `torch_save::save` writes of the object the placeholders stand for. Returns the lazy
/// storages' bytes written by all processes.
pub(crate) fn write_torch_save(
    obj: &PyObj,
    path: &Path,
    lazy: &mut dyn LazyTensors,
    pg: &dyn ProcessGroup,
) -> Result<u64> {
    let archive = torch_save::archive_name(path);
    let name = path.display().to_string();
    let plan = pg.agree(PlannedArchive::new(obj, &archive, &name, lazy))?;
    let me = (pg.rank(), pg.world_size());
    let reports = write_planned_file(
        path,
        plan.file_len(),
        pg,
        |file, tmp| torch_save::write_lazy_share(&plan, lazy, file, (path, tmp), me),
        |file, _, all| {
            let crcs: HashMap<usize, u32> = all.iter().flatten().copied().collect();
            plan.write_frame(file, &crcs)
        },
    )?;
    Ok(reports.iter().flatten().map(|&(i, _)| plan.span(i).1).sum())
}

/// `obj` (a state dict) written as the DCP directory `out`, its placeholder tensors streamed
/// by `lazy`: process 0 stages the temporary directory with the data file at its planned
/// length, each process writes the archives of its share of the tensors (process 0 also the
/// non-tensor values; the tensors `lazy` cuts from one read of its input are one process's,
/// written one after another), and process 0 writes `.metadata` and renames the directory into
/// place. The data file is the same for any number of processes (`.metadata` differs only in
/// its random save id). Returns the tensor bytes written.
///
/// With [`Compression::Zstd`] the frames' lengths are known only once written, so process 0
/// writes the whole directory in order and the others wait for its outcome.
pub(crate) fn write_dcp(
    obj: &PyObj,
    out: &Path,
    lazy: &mut dyn LazyTensors,
    pg: &dyn ProcessGroup,
    opts: &DcpWriteOptions,
) -> Result<u64> {
    let obj = obj.values_only("a DCP checkpoint")?;
    if opts.compression == Compression::Zstd {
        return pg.on_root(|| crate::io::dcp::save_dcp_compressed(&obj, out, lazy));
    }
    let plan = pg.agree(PlannedDcp::new(&obj, out, lazy))?;
    let tmp = pg.on_root(|| plan.stage(out))?;
    let mine = plan.write_share(&tmp, (pg.rank(), pg.world_size()), lazy);
    let committed = pg
        .all_gather_agreed(mine)
        .and_then(|_| pg.on_root(|| plan.commit(&tmp, out)));
    if committed.is_err() && pg.rank() == 0 {
        crate::storage::discard_tmp_dir(&tmp);
    }
    committed.map(|()| plan.tensor_bytes())
}

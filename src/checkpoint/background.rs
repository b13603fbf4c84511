//! Background saves: the state is snapshotted into staging buffers under a hard memory cap,
//! and written, merged and committed on a background thread while training continues.
//!
//! The background threads never use the process group (training owns it): each writing rank
//! leaves a report file in the temporary directory, and rank 0's thread waits for every report,
//! then merges and commits exactly as a foreground save does.

use super::save::{commit, save, write_rank, SaveOptions};
use super::{save::Reports, GroupContext};
use crate::collectives::ProcessGroupExt;
use crate::error::{Error, Result};
use crate::flat_param::ModelLayout;
use crate::optim_state::{OptimParams, OptimStateDict, Value};
use crate::tensor::{HostTensor, Tensor};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How [`BackgroundSaver::save`] ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveMode {
    /// Snapshotted; the write continues on a background thread.
    Background,
    /// Some rank's state did not fit the staging cap, so every rank saved in the foreground
    /// (the checkpoint is committed when the call returns).
    Foreground,
}

/// Saves sharded checkpoints in the background (see the module docs).
///
/// One save is in flight at a time: [`BackgroundSaver::save`] first waits for the previous one.
/// The staging buffers are the crate's large-buffer cache
/// ([`crate::tensor::set_buffer_cache_limit`]): a snapshot's buffers return to it when written,
/// and the next snapshot of the same state reuses them instead of growing.
#[derive(Debug)]
pub struct BackgroundSaver {
    cap: usize,
    timeout: Duration,
    pending: Option<JoinHandle<Result<()>>>,
}

impl BackgroundSaver {
    /// A saver whose snapshot on any rank may hold at most `cap_bytes` of tensor data.
    pub fn new(cap_bytes: usize) -> Self {
        BackgroundSaver {
            cap: cap_bytes,
            timeout: Duration::from_secs(600),
            pending: None,
        }
    }

    /// How long rank 0's background thread waits for the other ranks' files before giving up
    /// (default 10 minutes).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether a save is still being written.
    pub fn in_flight(&self) -> bool {
        self.pending.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// Waits for the save in flight, if any, and returns its outcome. On rank 0 that is the
    /// commit's outcome; on other ranks, whether their own data file was written.
    pub fn wait(&mut self) -> Result<()> {
        match self.pending.take() {
            None => Ok(()),
            Some(h) => h.join().unwrap_or_else(|panic| {
                Err(Error::WorkerPanicked {
                    worker: "the background save's writer thread".into(),
                    message: panic_message(panic.as_ref()),
                })
            }),
        }
    }

    /// Starts saving this rank's local optimizer state `osd` to `dir` (collective over the
    /// job, like `Fsdp::save_optim_checkpoint`): waits for the previous save, snapshots, and
    /// returns while a background thread writes. Falls back to a foreground save on every rank
    /// when some rank's state exceeds the cap.
    pub fn save<'a, T: Tensor>(
        &mut self,
        group: impl Into<GroupContext<'a>>,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        dir: impl AsRef<Path>,
    ) -> Result<SaveMode> {
        self.start(group.into(), osd, params, None, dir.as_ref())
    }

    /// [`BackgroundSaver::save`] that also saves this rank's parameter tensors, as
    /// `Fsdp::save_checkpoint` does (they count against the cap and are snapshotted too).
    pub fn save_checkpoint<'a, T: Tensor>(
        &mut self,
        group: impl Into<GroupContext<'a>>,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        model: &[Option<T>],
        dir: impl AsRef<Path>,
    ) -> Result<SaveMode> {
        self.start(group.into(), osd, params, Some(model), dir.as_ref())
    }

    /// The protocol of a background save: agree (on every rank) whether every snapshot fits
    /// the cap, else save in the foreground; rank 0 makes the temporary directory; each
    /// writing rank snapshots its state; a thread writes and (on rank 0) commits.
    fn start<T: Tensor>(
        &mut self,
        ctx: GroupContext<'_>,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        model: Option<&[Option<T>]>,
        dir: &Path,
    ) -> Result<SaveMode> {
        let pg = ctx.pg.clone();
        // The previous save finishes first, on every rank, so that two never interleave.
        let previous = self.wait();
        let fits = staged_bytes(osd, model) <= self.cap;
        let fits_everywhere = pg
            .all_gather_agreed(previous.map(|()| fits))?
            .into_iter()
            .all(|fits| fits);
        if !fits_everywhere {
            save(ctx, osd, params, model, dir, &SaveOptions::default())?;
            return Ok(SaveMode::Foreground);
        }
        let rank = pg.rank();
        let tmp = (rank == 0).then(|| super::prepare_output(dir, &[]));
        let tmp: PathBuf = pg.broadcast_agreed(tmp.as_ref(), 0)?;
        let snapshot = ctx.writes_files.then(|| snapshot(osd, model)).transpose()?;
        let job = WriteJob {
            layout: ctx.layout.clone(),
            layout_rank: ctx.layout_rank,
            writers: ctx.layout.world_size,
            params: params.clone(),
            timeout: self.timeout,
            rank,
            tmp,
            dir: dir.to_path_buf(),
        };
        let handle = std::thread::Builder::new()
            .name(format!("fsdp-save-{rank}"))
            .spawn(move || job.run(snapshot))
            .map_err(Error::io("starting the background save thread for", dir))?;
        self.pending = Some(handle);
        Ok(SaveMode::Background)
    }
}

/// Bytes of tensor data a snapshot of `osd` (and the model's tensors) takes.
fn staged_bytes<T: Tensor>(osd: &OptimStateDict<T>, model: Option<&[Option<T>]>) -> usize {
    let states: usize = osd
        .state
        .values()
        .flat_map(|st| st.values())
        .filter_map(|v| match v {
            Value::Tensor(t) => Some(t.numel() * t.dtype().size()),
            _ => None,
        })
        .sum();
    let params: usize = model
        .unwrap_or_default()
        .iter()
        .flatten()
        .map(|t| t.numel() * t.dtype().size())
        .sum();
    states + params
}

/// Private copies of every tensor of `osd` and of the model's tensors, from the buffer cache.
type Snapshot = (OptimStateDict<HostTensor>, Option<Vec<Option<HostTensor>>>);

fn snapshot<T: Tensor>(osd: &OptimStateDict<T>, model: Option<&[Option<T>]>) -> Result<Snapshot> {
    let copy = |t: &T| {
        let h = t.to_host()?;
        HostTensor::from_bytes(h.dtype(), h.shape(), h.as_bytes())
    };
    let dict = osd.try_map(copy)?;
    let params = model
        .map(|m| {
            m.iter()
                .map(|t| t.as_ref().map(copy).transpose())
                .collect::<Result<Vec<_>>>()
        })
        .transpose()?;
    Ok((dict, params))
}

/// What the background thread needs: everything owned, nothing borrowed from the caller.
struct WriteJob {
    layout: ModelLayout,
    layout_rank: usize,
    writers: usize,
    params: OptimParams,
    timeout: Duration,
    rank: usize,
    tmp: PathBuf,
    dir: PathBuf,
}

impl WriteJob {
    /// Writes this rank's file and report (when it writes one); on rank 0, waits for every
    /// report, then merges and commits, removing the temporary directory on failure.
    fn run(self, snapshot: Option<Snapshot>) -> Result<()> {
        if let Some((dict, model)) = snapshot {
            let report = write_rank(
                &self.layout,
                self.layout_rank,
                &dict,
                &self.params,
                model.as_deref(),
                &self.tmp,
                &Default::default(),
            );
            drop((dict, model));
            let failed = report.as_ref().err().cloned();
            write_report(&self.tmp, self.layout_rank, &report.map(Some))?;
            if let Some(e) = failed {
                return Err(e);
            }
        }
        if self.rank != 0 {
            return Ok(());
        }
        let result = collect_reports(&self.tmp, self.writers, self.timeout).and_then(|reports| {
            commit(
                &self.layout,
                reports,
                &self.tmp,
                &self.dir,
                &SaveOptions::default(),
            )
        });
        if result.is_err() {
            crate::storage::discard_tmp_dir(&self.tmp);
        }
        result
    }
}

impl Drop for BackgroundSaver {
    /// Waits for the save in flight: dropping the saver never abandons a half-written save.
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

type Report =
    std::result::Result<Option<(super::save::RankReport, Option<super::save::DictParts>)>, Error>;

fn report_path(tmp: &Path, rank: usize) -> PathBuf {
    tmp.join(format!("report-{rank}.json"))
}

/// Writes a rank's report atomically (temporary name, then rename), so rank 0 never reads a
/// partial one.
fn write_report(tmp: &Path, rank: usize, report: &Report) -> Result<()> {
    let bytes = serde_json::to_vec(report).map_err(|e| Error::Serialization {
        what: "background save report".into(),
        reason: e.to_string(),
    })?;
    let part = tmp.join(format!(".report-{rank}.json.part"));
    super::save::write_synced(&part, &bytes)?;
    let path = report_path(tmp, rank);
    std::fs::rename(&part, &path).map_err(Error::io("renaming", &path))
}

/// Rank 0: waits for the reports of ranks `0..writers`, then removes them.
fn collect_reports(tmp: &Path, writers: usize, timeout: Duration) -> Result<Reports> {
    let start = Instant::now();
    let mut reports: Vec<Option<Report>> = (0..writers).map(|_| None).collect();
    while reports.iter().any(Option::is_none) {
        for (r, slot) in reports.iter_mut().enumerate() {
            if slot.is_none() {
                let path = report_path(tmp, r);
                let read =
                    crate::storage::read_regular(&path, crate::storage::SMALL_METADATA_MAX_BYTES);
                if let Ok(bytes) = read {
                    let report: Report =
                        serde_json::from_slice(&bytes).map_err(|e| Error::Serialization {
                            what: format!("background save report `{}`", path.display()),
                            reason: e.to_string(),
                        })?;
                    *slot = Some(report);
                }
            }
        }
        if reports.iter().any(Option::is_none) {
            if start.elapsed() > timeout {
                let missing: Vec<usize> = (0..writers).filter(|&r| reports[r].is_none()).collect();
                return Err(Error::TimedOut {
                    what: format!(
                        "the background save's data files of ranks {missing:?} in `{}`",
                        tmp.display()
                    ),
                    waited: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    for r in 0..writers {
        let path = report_path(tmp, r);
        std::fs::remove_file(&path).map_err(Error::io("removing", &path))?;
    }
    reports.into_iter().flatten().collect()
}

/// The message of a panic payload, when it is a string (as `panic!` with a message makes it).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".into())
}

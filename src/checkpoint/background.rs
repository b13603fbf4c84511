//! Background saves: the state is snapshotted into staging buffers under a hard memory cap,
//! and written, merged and committed on a background thread while training continues.
//!
//! The background threads never use the process group (training owns it): each writing rank
//! leaves a report file in the temporary directory, and rank 0's thread waits for every report,
//! then merges and commits exactly as a foreground save does.

use super::save::{commit, make_tmp_dir, save, write_rank, SaveOptions};
use super::{fs_err, save::Reports, GroupContext};
use crate::collectives::ProcessGroupExt;
use crate::error::{Error, Result};
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
            Some(h) => h.join().unwrap_or_else(|_| {
                Err(Error::Io {
                    op: "saving in the background (the writer thread panicked)".into(),
                    path: String::new(),
                    reason: "panic".into(),
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

    fn start<T: Tensor>(
        &mut self,
        ctx: GroupContext<'_>,
        osd: &OptimStateDict<T>,
        params: &OptimParams,
        model: Option<&[Option<T>]>,
        dir: &Path,
    ) -> Result<SaveMode> {
        let dir = dir.to_path_buf();
        let pg = ctx.pg.clone();
        // The previous save finishes first, on every rank, so that two never interleave.
        let previous = self.wait();
        let need: usize = osd
            .state
            .values()
            .flat_map(|st| st.values())
            .filter_map(|v| match v {
                Value::Tensor(t) => Some(t.numel() * t.dtype().size()),
                _ => None,
            })
            .sum::<usize>()
            + model
                .unwrap_or_default()
                .iter()
                .flatten()
                .map(|t| t.numel() * t.dtype().size())
                .sum::<usize>();
        let fits: Vec<(bool, Option<Error>)> =
            pg.all_gather_object(&(need <= self.cap, previous.err()))?;
        if let Some(e) = fits.iter().find_map(|(_, e)| e.clone()) {
            return Err(e);
        }
        if fits.iter().any(|(fits, _)| !fits) {
            save(ctx, osd, params, model, &dir, &SaveOptions::default())?;
            return Ok(SaveMode::Foreground);
        }
        let rank = pg.rank();
        let tmp: std::result::Result<PathBuf, Error> = if rank == 0 {
            make_tmp_dir(&dir)
        } else {
            Ok(PathBuf::new())
        };
        let tmp = pg.broadcast_object((rank == 0).then_some(&tmp), 0)??;
        let writer = ctx.writes_files;
        // The snapshot: private copies of every tensor, from the buffer cache.
        let snapshot: Option<OptimStateDict<HostTensor>> = writer
            .then(|| {
                osd.try_map(|t: &T| {
                    let h = t.to_host()?;
                    HostTensor::from_bytes(h.dtype(), h.shape(), h.as_bytes())
                })
            })
            .transpose()?;
        let model_snapshot: Option<Vec<Option<HostTensor>>> = model
            .filter(|_| writer)
            .map(|m| {
                m.iter()
                    .map(|t| {
                        t.as_ref()
                            .map(|t| {
                                let h = t.to_host()?;
                                HostTensor::from_bytes(h.dtype(), h.shape(), h.as_bytes())
                            })
                            .transpose()
                    })
                    .collect()
            })
            .transpose()?;
        let layout = ctx.layout.clone();
        let layout_rank = ctx.layout_rank;
        let writers = ctx.layout.world_size;
        let params = params.clone();
        let timeout = self.timeout;
        let shown = dir_display(&dir);
        let handle = std::thread::Builder::new()
            .name(format!("fsdp-save-{rank}"))
            .spawn(move || -> Result<()> {
                if let Some(snapshot) = snapshot {
                    let report = write_rank(
                        &layout,
                        layout_rank,
                        &snapshot,
                        &params,
                        model_snapshot.as_deref(),
                        &tmp,
                        &Default::default(),
                    );
                    drop(snapshot);
                    drop(model_snapshot);
                    let failed = report.as_ref().err().cloned();
                    write_report(&tmp, layout_rank, &report.map(Some))?;
                    if let Some(e) = failed {
                        return Err(e);
                    }
                }
                if rank != 0 {
                    return Ok(());
                }
                let result = collect_reports(&tmp, writers, timeout).and_then(|reports| {
                    commit(&layout, reports, &tmp, &dir, &SaveOptions::default())
                });
                if result.is_err() {
                    let _ = std::fs::remove_dir_all(&tmp);
                }
                result
            })
            .map_err(|e| Error::Io {
                op: "starting the background save thread for".into(),
                path: shown,
                reason: e.to_string(),
            })?;
        self.pending = Some(handle);
        Ok(SaveMode::Background)
    }
}

impl Drop for BackgroundSaver {
    /// Waits for the save in flight: dropping the saver never abandons a half-written save.
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

fn dir_display(p: &Path) -> String {
    p.display().to_string()
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
    std::fs::rename(&part, &path).map_err(fs_err("renaming", &path))
}

/// Rank 0: waits for the reports of ranks `0..writers`, then removes them.
fn collect_reports(tmp: &Path, writers: usize, timeout: Duration) -> Result<Reports> {
    let start = Instant::now();
    let mut reports: Vec<Option<Report>> = (0..writers).map(|_| None).collect();
    while reports.iter().any(Option::is_none) {
        for (r, slot) in reports.iter_mut().enumerate() {
            if slot.is_none() {
                let path = report_path(tmp, r);
                if let Ok(bytes) = std::fs::read(&path) {
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
                return Err(Error::Io {
                    op: format!("waiting {timeout:?} for the data files of ranks {missing:?} in"),
                    path: tmp.display().to_string(),
                    reason: "the background save of those ranks did not finish".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    for r in 0..writers {
        let path = report_path(tmp, r);
        std::fs::remove_file(&path).map_err(fs_err("removing", &path))?;
    }
    Ok(reports
        .into_iter()
        .map(|r| r.expect("all collected"))
        .collect())
}

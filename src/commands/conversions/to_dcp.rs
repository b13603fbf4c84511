//! A state dict file written as a DCP directory, as `torch_save_to_dcp` writes it.

use super::coordinate::write_dcp;
use crate::collectives::{ProcessGroup, ProcessGroupExt};
use crate::error::Result;
use crate::io::dcp::{DcpWriteOptions, Headers, Views};
use std::path::Path;

/// Writes the state dict in the `torch.save` (or `.safetensors`) file `src` as the DCP
/// directory `dst`, as `torch.distributed.checkpoint.format_utils.torch_save_to_dcp(src,
/// dst)` does (see [`crate::io::dcp::save_dcp`]). The tensors are streamed from the file
/// into their planned places in the data file, not loaded first. From a `torch.save` file, a
/// tensor that is its whole storage (what `torch.save` of a state dict writes) streams 4 MiB
/// at a time; a storage that tensors view in part (tied weights, views at an offset,
/// transposed or strided views, a storage larger than its views) is read whole once, its
/// CRC-32 checked, and every tensor viewing it is written from that read, contiguous as
/// [`crate::io::torch_save::load`] materializes it. Memory holds the largest such storage
/// plus 4 MiB buffers. A legacy-format file, or one whose strided views `load` refuses to
/// copy ([`Error::TensorExpansion`]), is loaded as `load` loads it. The directory is byte for
/// byte what [`crate::io::dcp::save_dcp`] writes of the loaded dict.
///
/// Run by the processes of `pg` (see [the module](super)): each process streams its share of
/// the tensors into the one data file (the tensors viewing one shared storage are one
/// process's, which reads it once), and process 0 writes `.metadata` and installs the
/// directory; a file that is loaded is converted by process 0 alone. Returns the tensor bytes
/// written.
///
/// [`Error::TensorExpansion`]: crate::Error::TensorExpansion
pub fn torch_save_to_dcp(src: &Path, dst: &Path, pg: &dyn ProcessGroup) -> Result<u64> {
    torch_save_to_dcp_with(src, dst, pg, &DcpWriteOptions::default())
}

/// [`torch_save_to_dcp`] with the writer's options: [`Compression::Zstd`] stores every item
/// as a zstd frame, as `FileSystemWriter(_extensions=[ZStandard()])` does (written by
/// process 0 alone, in file order, the tensors still streamed from the file; a shared
/// storage whose views are apart in the dict is read again for each run of them).
///
/// [`Compression::Zstd`]: crate::io::dcp::Compression::Zstd
pub fn torch_save_to_dcp_with(
    src: &Path,
    dst: &Path,
    pg: &dyn ProcessGroup,
    opts: &DcpWriteOptions,
) -> Result<u64> {
    let headers = pg.agree(Headers::read(src))?;
    let streamer = pg.agree(headers.streamer(src, dst, Views::Shared))?;
    match streamer {
        Some(mut lazy) => write_dcp(headers.obj(), dst, lazy.as_mut(), pg, opts),
        None => pg.on_root(|| crate::io::dcp::save_dcp_with(&crate::io::load(src)?, dst, opts)),
    }
}

#[cfg(test)]
mod tests {
    use super::write_dcp;
    use crate::collectives::{Solo, ThreadGroup};
    use crate::io::dcp::{Compression, DcpWriteOptions};
    use crate::io::torch_save::{load_headers, FileTensors, Views};
    use std::path::{Path, PathBuf};

    /// `tests/golden/dcp/shared_storage/input.pt`: storages 0 (float32, 256 bytes, the
    /// largest), 1, 3 and 5 are viewed in part; 2 and 4 only whole.
    fn input() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/dcp/shared_storage/input.pt")
    }

    /// Converts `input()` into `out` as process `pg` with `opts`: (whole reads of shared
    /// storages, most bytes held at once).
    fn convert(
        out: &Path,
        pg: &dyn crate::collectives::ProcessGroup,
        opts: &DcpWriteOptions,
    ) -> (usize, u64) {
        let src = input();
        let headers = load_headers(&src).unwrap();
        let mut lazy = FileTensors::open(&src, &headers, out, Views::Shared)
            .unwrap()
            .expect("a file of shared storages streams");
        write_dcp(&headers.obj, out, &mut lazy, pg, opts).unwrap();
        lazy.held_stats()
    }

    #[test]
    fn each_shared_storage_is_read_once_and_memory_holds_at_most_the_largest() {
        let tmp = tempfile::tempdir().unwrap();
        let largest = 256;
        assert_eq!(
            convert(&tmp.path().join("one"), &Solo, &DcpWriteOptions::default()),
            (4, largest)
        );
        // Split by storage: each is read by one process.
        for ws in [2, 3] {
            let out = tmp.path().join(format!("split{ws}"));
            let stats = ThreadGroup::run(ws, |pg| convert(&out, &pg, &DcpWriteOptions::default()));
            assert_eq!(
                stats.iter().map(|s| s.0).sum::<usize>(),
                4,
                "{ws} processes"
            );
            assert!(stats.iter().all(|s| s.1 <= largest), "{ws} processes");
        }
        // Zstd frames go in file order: a storage whose views are apart is read again, one
        // storage held at a time all the same.
        let zstd = DcpWriteOptions::default().compression(Compression::Zstd);
        let (reads, held) = convert(&tmp.path().join("zstd"), &Solo, &zstd);
        assert!(reads >= 4, "{reads}");
        assert_eq!(held, largest);
    }

    #[test]
    fn only_whole_storages_stream_with_views_whole() {
        let src = input();
        let headers = load_headers(&src).unwrap();
        assert!(FileTensors::open(&src, &headers, &src, Views::Whole)
            .unwrap()
            .is_none());
    }
}

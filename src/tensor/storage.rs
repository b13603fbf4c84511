//! Byte storage behind [`super::HostTensor`]: small buffers on the heap, large ones mapped
//! directly from the kernel into transparent huge pages and recycled through a bounded cache.
//!
//! A large buffer is filled once, by the copy that creates it (a collective's receive, a
//! shard cut from a full tensor), so the cost of its first touch — a page fault and a kernel
//! page clear per page — is most of the cost of creating it: copying 800 MB into fresh 4 KiB
//! pages ran at a tenth of `memcpy` speed on the benchmark host. Two remedies:
//! - mapping 2 MiB-aligned and advising `MADV_HUGEPAGE` turns 512 faults into one (PyTorch's
//!   CPU allocator gives the same advice under `THP_MEM_ALLOC_ENABLE`). Buffers that reads
//!   from files fill ([`Storage::for_reads`]) are the exception: a fresh huge page can cost
//!   more than the disk read it receives (see there);
//! - a dropped large buffer is kept in a process-wide cache, bounded by
//!   [`set_buffer_cache_limit`], and reused by the next allocation of about its size, so a job
//!   that checkpoints repeatedly pays the page faults once (the idea of PyTorch's caching
//!   allocators). A buffer about to be overwritten whole is handed out as it is; one asked
//!   for zeroed is cleared first.

/// Buffers at least this large are mapped (on Linux) and cached; smaller ones live on the
/// heap. Buffers of 2 MiB and more also start on a huge-page boundary.
pub(crate) const MAPPED_THRESHOLD: usize = 256 << 10;

/// 8-byte aligned, zero-initialised byte storage of a fixed length.
pub(crate) struct Storage {
    buf: Buf,
    nbytes: usize,
}

enum Buf {
    Heap(Vec<u64>),
    #[cfg(target_os = "linux")]
    Mapped(mapped::Mapping),
}

impl Storage {
    /// `nbytes` zero bytes.
    pub(crate) fn zeroed(nbytes: usize) -> Self {
        Self::new(nbytes, true, true)
    }

    /// `nbytes` bytes of unspecified (but initialised) content, for a caller that overwrites
    /// all of them: a recycled buffer keeps what its previous tensor held.
    pub(crate) fn for_overwrite(nbytes: usize) -> Self {
        Self::new(nbytes, false, true)
    }

    /// [`Storage::for_overwrite`] for bytes that reads from files will fill (a checkpoint
    /// load): a fresh mapping gets no huge-page advice. Such a load is paced by the disk, and
    /// its first touch of fresh memory is what makes the first call in a process slower than
    /// later ones (which reuse cached buffers): on the benchmark VM, the first load of a 2 GiB
    /// checkpoint took about twice as long in huge pages as in 4 KiB pages (the kernel hands
    /// out huge pages from free memory the hypervisor has reclaimed, and each one is faulted
    /// back in whole), while later loads ran alike.
    pub(crate) fn for_reads(nbytes: usize) -> Self {
        Self::new(nbytes, false, false)
    }

    fn new(nbytes: usize, zero: bool, huge: bool) -> Self {
        #[cfg(target_os = "linux")]
        if nbytes >= MAPPED_THRESHOLD {
            if let Some(m) = mapped::take(nbytes, zero, huge) {
                return Storage {
                    buf: Buf::Mapped(m),
                    nbytes,
                };
            }
        }
        Storage {
            buf: Buf::Heap(vec![0u64; nbytes.div_ceil(8)]),
            nbytes,
        }
    }

    /// A storage holding a copy of `bytes`.
    pub(crate) fn copy_of(bytes: &[u8]) -> Self {
        let mut s = Self::for_overwrite(bytes.len());
        s.bytes_mut().copy_from_slice(bytes);
        s
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.nbytes
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.buf {
            Buf::Heap(words) => &bytemuck::cast_slice::<u64, u8>(words)[..self.nbytes],
            #[cfg(target_os = "linux")]
            Buf::Mapped(m) => m.bytes(),
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.nbytes;
        match &mut self.buf {
            Buf::Heap(words) => &mut bytemuck::cast_slice_mut::<u64, u8>(words)[..n],
            #[cfg(target_os = "linux")]
            Buf::Mapped(m) => m.bytes_mut(),
        }
    }
}

impl Clone for Storage {
    fn clone(&self) -> Self {
        Self::copy_of(self.bytes())
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Buf::Mapped(m) = std::mem::replace(&mut self.buf, Buf::Heap(Vec::new())) {
            mapped::give_back(m);
        }
    }
}

/// Sets how many bytes of dropped large tensor buffers the process keeps for reuse, releasing
/// cached buffers beyond the new limit at once. 0 disables the cache.
///
/// The default is an eighth of physical memory, or `FSDP_BUFFER_CACHE_MIB` mebibytes when that
/// environment variable is set. Only buffers of at least 4 MiB are cached, and only on Linux.
pub fn set_buffer_cache_limit(bytes: usize) {
    #[cfg(target_os = "linux")]
    mapped::set_limit(bytes);
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// The current limit of the buffer cache in bytes (see [`set_buffer_cache_limit`]).
pub fn buffer_cache_limit() -> usize {
    #[cfg(target_os = "linux")]
    return mapped::limit();
    #[cfg(not(target_os = "linux"))]
    0
}

/// Bytes of dropped buffers the cache holds right now.
pub fn cached_buffer_bytes() -> usize {
    #[cfg(target_os = "linux")]
    return mapped::held();
    #[cfg(not(target_os = "linux"))]
    0
}

/// Returns every cached buffer to the operating system.
pub fn release_cached_buffers() {
    #[cfg(target_os = "linux")]
    mapped::release();
}

#[cfg(target_os = "linux")]
mod mapped {
    use std::collections::BTreeMap;
    use std::ptr::NonNull;
    use std::sync::{Mutex, MutexGuard};

    const HUGE_PAGE: usize = 2 << 20;

    /// Dropped mappings kept for reuse: by size for best fit, and by age for eviction.
    struct Cache {
        /// `None` until first used: then the default limit is computed.
        limit: Option<usize>,
        held: usize,
        /// Next age stamp.
        seq: u64,
        by_size: BTreeMap<(usize, u64), Mapping>,
        by_age: BTreeMap<u64, usize>,
    }

    static CACHE: Mutex<Cache> = Mutex::new(Cache {
        limit: None,
        held: 0,
        seq: 0,
        by_size: BTreeMap::new(),
        by_age: BTreeMap::new(),
    });

    fn cache() -> MutexGuard<'static, Cache> {
        // The cache holds no invariant a panic could break halfway: enter it anyway.
        let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if c.limit.is_none() {
            c.limit = Some(default_limit());
        }
        c
    }

    fn default_limit() -> usize {
        if let Some(mib) = std::env::var("FSDP_BUFFER_CACHE_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
        {
            return mib.saturating_mul(1 << 20);
        }
        // SAFETY: sysconf has no preconditions.
        let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
        usize::try_from(pages)
            .unwrap_or(0)
            .saturating_mul(page_size())
            / 8
    }

    impl Cache {
        /// Unmaps the oldest buffers until at most `keep` bytes are held.
        fn shrink_to(&mut self, keep: usize) {
            while self.held > keep {
                let Some((seq, size)) = self.by_age.pop_first() else {
                    break;
                };
                if let Some(m) = self.by_size.remove(&(size, seq)) {
                    self.held -= m.mapped;
                }
            }
        }

        /// The smallest cached mapping of `need..=max` bytes, removed from the cache.
        fn take_fit(&mut self, need: usize, max: usize) -> Option<Mapping> {
            let (&(size, seq), _) = self.by_size.range((need, 0)..=(max, u64::MAX)).next()?;
            self.by_age.remove(&seq);
            let m = self.by_size.remove(&(size, seq))?;
            self.held -= m.mapped;
            Some(m)
        }

        fn put(&mut self, m: Mapping) {
            let seq = self.seq;
            self.seq += 1;
            self.held += m.mapped;
            self.by_age.insert(seq, m.mapped);
            self.by_size.insert((m.mapped, seq), m);
        }
    }

    /// A mapping for `len` bytes: a cached one of about that size (zeroed if `zero`), else a
    /// fresh one (advised into huge pages if `huge`). `None` when the kernel refuses a fresh
    /// mapping.
    pub(super) fn take(len: usize, zero: bool, huge: bool) -> Option<Mapping> {
        let need = len.checked_next_multiple_of(page_size())?;
        // Reuse a mapping at most an eighth larger than needed.
        let reused = cache().take_fit(need, need.saturating_add(need / 8));
        match reused {
            Some(mut m) => {
                m.len = len;
                if zero {
                    m.bytes_mut().fill(0);
                }
                Some(m)
            }
            None => Mapping::new(len, huge),
        }
    }

    /// Keeps a dropped mapping for reuse if it fits under the limit (evicting older ones).
    pub(super) fn give_back(m: Mapping) {
        let mut c = cache();
        let limit = c.limit.unwrap_or(0);
        if m.mapped > limit {
            return; // dropped: unmapped
        }
        c.shrink_to(limit - m.mapped);
        c.put(m);
    }

    pub(super) fn set_limit(bytes: usize) {
        let mut c = cache();
        c.limit = Some(bytes);
        c.shrink_to(bytes);
    }

    pub(super) fn limit() -> usize {
        cache().limit.unwrap_or(0)
    }

    pub(super) fn held() -> usize {
        cache().held
    }

    pub(super) fn release() {
        cache().shrink_to(0);
    }

    /// An anonymous private mapping; one that can hold a huge page starts on a 2 MiB boundary
    /// and is advised into huge pages, unless made for reads ([`super::Storage::for_reads`]).
    pub(super) struct Mapping {
        ptr: NonNull<u8>,
        /// Requested length in bytes.
        len: usize,
        /// Mapped length (a multiple of the page size).
        mapped: usize,
    }

    // SAFETY: `Mapping` owns its memory exclusively, like a `Vec<u8>`.
    unsafe impl Send for Mapping {}
    // SAFETY: shared access only reads (`bytes`); writes need `&mut self`.
    unsafe impl Sync for Mapping {}

    fn page_size() -> usize {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
    }

    impl Mapping {
        /// `len` zero bytes (in huge pages if `huge` and large enough), or `None` if the kernel
        /// refuses the mapping (the caller falls back to the heap, which then reports a failure
        /// the usual way).
        fn new(len: usize, huge: bool) -> Option<Self> {
            let mapped = len.checked_next_multiple_of(page_size())?;
            // Only a buffer that can hold a huge page is worth aligning to one.
            let huge = huge && mapped >= HUGE_PAGE;
            let reserve = mapped.checked_add(if huge { HUGE_PAGE } else { 0 })?;
            // SAFETY: a fresh anonymous mapping; no existing memory is affected.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    reserve,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return None;
            }
            let base = base as usize;
            let start = if huge {
                base.next_multiple_of(HUGE_PAGE)
            } else {
                base
            };
            let (head, tail) = (start - base, reserve - (start - base) - mapped);
            // SAFETY: both ranges are page-aligned parts of the mapping made above that
            // `Mapping` will not use; unmapping them cannot fail for valid ranges, and a
            // failure would only leave address space reserved.
            unsafe {
                if head > 0 {
                    libc::munmap(base as *mut libc::c_void, head);
                }
                if tail > 0 {
                    libc::munmap((start + mapped) as *mut libc::c_void, tail);
                }
                // Advice only: a kernel without transparent huge pages ignores it.
                if huge {
                    libc::madvise(start as *mut libc::c_void, mapped, libc::MADV_HUGEPAGE);
                }
            }
            Some(Mapping {
                ptr: NonNull::new(start as *mut u8)?,
                len,
                mapped,
            })
        }

        pub(super) fn bytes(&self) -> &[u8] {
            // SAFETY: `ptr` points to `mapped >= len` readable bytes owned by `self`, zero
            // until written through `bytes_mut`.
            unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
        }

        pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
            // SAFETY: as in `bytes`, and `&mut self` makes the access exclusive.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly the range `new` kept; no reference to it outlives `self`.
            unsafe {
                libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.mapped);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_storages_start_zeroed_keep_what_is_written_and_clone_deeply() {
        for len in [
            0,
            1,
            100,
            MAPPED_THRESHOLD - 1,
            MAPPED_THRESHOLD,
            3 * MAPPED_THRESHOLD + 12345,
        ] {
            let mut s = Storage::zeroed(len);
            assert_eq!(s.len(), len);
            assert!(s.bytes().iter().all(|&b| b == 0), "length {len}");
            for (i, b) in s.bytes_mut().iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
            let c = s.clone();
            s.bytes_mut().fill(7);
            assert!(c
                .bytes()
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i % 251) as u8));
            assert_eq!(c.bytes().as_ptr() as usize % 8, 0, "8-byte aligned");
        }
    }

    #[test]
    fn buffers_for_reads_and_for_overwrite_hold_what_is_written_at_every_size() {
        // Fresh mappings for reads are placed without the 2 MiB alignment and huge-page advice
        // of the others; both must still be whole, writable and 8-byte aligned.
        for len in [
            0,
            1,
            MAPPED_THRESHOLD,
            2 * 1024 * 1024 + 4097,
            5 * 1024 * 1024,
        ] {
            for mut s in [Storage::for_reads(len), Storage::for_overwrite(len)] {
                assert_eq!(s.len(), len);
                for (i, b) in s.bytes_mut().iter_mut().enumerate() {
                    *b = (i % 253) as u8;
                }
                assert!(s
                    .bytes()
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i % 253) as u8));
                assert_eq!(s.bytes().as_ptr() as usize % 8, 0, "length {len}");
            }
        }
    }
}

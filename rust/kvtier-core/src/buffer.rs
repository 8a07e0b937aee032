//! Aligned anonymous host memory for KV pages.
//!
//! A [`HostRegion`] is one `mmap`ed anonymous mapping whose base is aligned to at least 4096 bytes (the
//! O_DIRECT alignment), optionally backed by 2 MiB huge pages, pre-faulted in parallel so the first copy
//! into it never page-faults on a hot path. Its memory is freed (`munmap`) exactly once, when the region is
//! dropped; registrations with the CUDA driver (see [`crate::cuda`]) are undone before that.
//!
//! Invariants:
//! - `base` is aligned to `alignment`, `len <= mapped_len`, and `[base, base + mapped_len)` is one mapping
//!   owned by this value (trimmed with `munmap` at creation, unmapped in `Drop`).
//! - The core never reads or writes the bytes itself except when pre-faulting; callers that hand out
//!   pointers (DLPack views, DMA descriptors) keep an `Arc<HostRegion>` alive for as long as those are used.

use std::ptr::NonNull;
use std::sync::Mutex;

use crate::cuda::Registration;
use crate::error::{Error, Result};
pub use crate::progress::Progress;

/// The minimum alignment: O_DIRECT needs 4096-byte aligned buffers on the file systems kvtier targets.
pub const MIN_ALIGNMENT: usize = 4096;
/// Size of one huge page on x86-64 and aarch64 with 4 KiB base pages.
pub const HUGE_PAGE: usize = 2 << 20;
const BASE_PAGE: usize = 4096;

/// What the caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// Plain base pages.
    Off,
    /// Explicit (hugetlbfs) pages if the system has free ones, else transparent huge pages, else base pages.
    Auto,
    /// Transparent huge pages only (madvise), falling back to base pages if THP is disabled.
    Transparent,
    /// Explicit huge pages or an error.
    Required,
}

impl HugePages {
    /// Parses the Python-facing spelling.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            "transparent" => Ok(Self::Transparent),
            "required" => Ok(Self::Required),
            other => Err(Error::arg(
                "huge_pages",
                format!("{other:?} is not one of 'auto', 'off', 'transparent', 'required'"),
            )),
        }
    }
}

/// What the region actually got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageKind {
    /// 4 KiB pages.
    Base,
    /// Transparent huge pages were requested with `madvise(MADV_HUGEPAGE)` (the kernel may still split).
    Transparent,
    /// Explicit hugetlb pages (`MAP_HUGETLB`).
    Explicit,
}

impl PageKind {
    /// Short name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            PageKind::Base => "base",
            PageKind::Transparent => "transparent",
            PageKind::Explicit => "explicit",
        }
    }
}

/// Options for [`HostRegion::new`].
#[derive(Clone, Debug)]
pub struct RegionOptions {
    /// Base alignment, a power of two ≥ [`MIN_ALIGNMENT`].
    pub alignment: usize,
    /// Huge-page policy.
    pub huge_pages: HugePages,
    /// Threads that pre-fault the region; `None` picks a default from the size and core count, `Some(0)`
    /// skips pre-faulting.
    pub prefault_threads: Option<usize>,
    /// Counts the bytes pre-faulted, for progress shown by another thread (large regions take seconds).
    pub progress: Option<std::sync::Arc<Progress>>,
}

impl Default for RegionOptions {
    fn default() -> Self {
        Self {
            alignment: MIN_ALIGNMENT,
            huge_pages: HugePages::Auto,
            prefault_threads: None,
            progress: None,
        }
    }
}

/// An aligned, owned anonymous mapping. See the module docs for its invariants.
#[derive(Debug)]
pub struct HostRegion {
    base: NonNull<u8>,
    len: usize,
    map_base: NonNull<u8>,
    map_len: usize,
    alignment: usize,
    kind: PageKind,
    fallback: Option<String>,
    registrations: Mutex<Vec<Registration>>,
}

// SAFETY: HostRegion owns its mapping exclusively; the raw pointers are plain addresses of memory that no
// thread-affine resource guards. Concurrent access to the bytes is the caller's responsibility (it hands
// out raw pointers only through unsafe or bounds-checked APIs), and the registration list is behind a Mutex.
unsafe impl Send for HostRegion {}
// SAFETY: see `Send`; every `&self` method only reads immutable fields or locks the Mutex.
unsafe impl Sync for HostRegion {}

fn round_up(v: usize, to: usize) -> Option<usize> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false)
}

impl HostRegion {
    /// Maps `nbytes` (rounded up to whole pages) of zeroed memory aligned as `opts` asks, then pre-faults it.
    pub fn new(nbytes: usize, opts: &RegionOptions) -> Result<Self> {
        if nbytes == 0 {
            return Err(Error::arg("nbytes", "must be positive, got 0"));
        }
        let a = opts.alignment;
        if !a.is_power_of_two() || a < MIN_ALIGNMENT {
            return Err(Error::arg(
                "alignment",
                format!("must be a power of two >= {MIN_ALIGNMENT}, got {a}"),
            ));
        }
        // Leave a margin far below isize::MAX so every offset computation on the region stays in range.
        if nbytes > (isize::MAX as usize) / 2 {
            return Err(Error::arg("nbytes", format!("{nbytes} is too large")));
        }
        let mut fallback = None;
        // Under one huge page, `auto` means base pages: rounding a small buffer up to 2 MiB only wastes memory.
        let policy = match opts.huge_pages {
            HugePages::Auto if nbytes < HUGE_PAGE => HugePages::Off,
            p => p,
        };
        let want_explicit = matches!(policy, HugePages::Auto | HugePages::Required);
        if want_explicit {
            match Self::map_explicit(nbytes, a) {
                Ok(r) => return r.finish(opts),
                Err(e) if policy == HugePages::Required => {
                    return Err(Error::HugePagesUnavailable(e))
                }
                Err(e) => fallback = Some(format!("explicit huge pages unavailable ({e})")),
            }
        }
        let want_thp = matches!(policy, HugePages::Auto | HugePages::Transparent);
        let thp = want_thp && thp_enabled();
        if want_thp && !thp {
            let msg = "transparent huge pages are disabled";
            fallback = Some(match fallback {
                Some(f) => format!("{f}; {msg}; using base pages"),
                None => format!("{msg}; using base pages"),
            });
        } else if let Some(f) = fallback.take() {
            fallback = Some(format!("{f}; using transparent huge pages"));
        }
        // THP needs 2 MiB-aligned extents to be used at all.
        let align = if thp { a.max(HUGE_PAGE) } else { a };
        let page = if thp { HUGE_PAGE } else { BASE_PAGE };
        let len = round_up(nbytes, page).ok_or_else(|| Error::arg("nbytes", "overflows"))?;
        let mut r = Self::map_aligned(len, align, 0)?;
        r.alignment = a;
        if thp {
            // SAFETY: [base, base+len) lies inside the mapping this value owns.
            let rc = unsafe { libc::madvise(r.base.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
            if rc == 0 {
                r.kind = PageKind::Transparent;
            } else {
                fallback = Some(format!(
                    "madvise(MADV_HUGEPAGE) failed: {}; using base pages",
                    std::io::Error::last_os_error()
                ));
            }
        }
        r.fallback = fallback;
        r.finish(opts)
    }

    fn map_explicit(nbytes: usize, align: usize) -> std::result::Result<Self, String> {
        let len = round_up(nbytes, HUGE_PAGE).ok_or("size overflows")?;
        let mut r = Self::map_aligned(len, align.max(HUGE_PAGE), libc::MAP_HUGETLB)
            .map_err(|e| e.to_string())?;
        r.kind = PageKind::Explicit;
        r.alignment = align;
        Ok(r)
    }

    /// Maps `len` bytes with base aligned to `align`, trimming the over-mapped head and tail.
    fn map_aligned(len: usize, align: usize, extra_flags: i32) -> Result<Self> {
        // mmap gives at least page alignment; ask for `align` more bytes when more is needed and trim.
        let natural = if extra_flags & libc::MAP_HUGETLB != 0 {
            HUGE_PAGE
        } else {
            BASE_PAGE
        };
        let slack = if align > natural { align } else { 0 };
        let map_len = len
            .checked_add(slack)
            .ok_or_else(|| Error::arg("nbytes", "overflows"))?;
        // an anonymous private mapping with no address hint has no preconditions; the result is
        // checked against MAP_FAILED before use.
        // SAFETY: an anonymous private mapping; the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                // No MAP_NORESERVE: with MAP_HUGETLB it turns "no huge pages" into SIGBUS on first touch instead
                // of ENOMEM here.
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os(format!("mmap of {map_len} bytes")));
        }
        let start = p as usize;
        let aligned = round_up(start, align).expect("mapping end fits in the address space");
        let head = aligned - start;
        let tail = map_len - head - len;
        if head > 0 {
            // SAFETY: [start, start+head) is the unaligned head of the mapping created above, unused.
            unsafe { libc::munmap(p, head) };
        }
        if tail > 0 {
            // SAFETY: [aligned+len, aligned+len+tail) is the unused tail of the same mapping.
            unsafe { libc::munmap((aligned + len) as *mut libc::c_void, tail) };
        }
        let base = NonNull::new(aligned as *mut u8).expect("mmap never returns null on success");
        Ok(Self {
            base,
            len,
            map_base: base,
            map_len: len,
            alignment: align,
            kind: PageKind::Base,
            fallback: None,
            registrations: Mutex::new(Vec::new()),
        })
    }

    fn finish(self, opts: &RegionOptions) -> Result<Self> {
        let threads = match opts.prefault_threads {
            Some(t) => t,
            None => default_prefault_threads(self.len),
        };
        if threads > 0 {
            self.prefault(threads, opts.progress.as_deref());
        }
        Ok(self)
    }

    /// Touches every base page so the kernel allocates (and zeroes) it now, using `threads` threads over
    /// disjoint ranges.
    fn prefault(&self, threads: usize, progress: Option<&Progress>) {
        let step = if self.kind == PageKind::Base {
            BASE_PAGE
        } else {
            HUGE_PAGE
        };
        let pages = self.len / step;
        let threads = threads.clamp(1, pages.max(1));
        let per = pages.div_ceil(threads);
        let base = self.base.as_ptr() as usize;
        if let Some(p) = progress {
            p.start(self.len);
        }
        std::thread::scope(|s| {
            for t in 0..threads {
                let first = t * per;
                let last = ((t + 1) * per).min(pages);
                if first >= last {
                    continue;
                }
                s.spawn(move || {
                    for pg in first..last {
                        // pg < pages, so the byte lies inside [base, base+len), which this region
                        // owns; the mapping is fresh, so writing zero cannot change what a reader sees.
                        // SAFETY: the byte lies inside this region's own fresh mapping.
                        unsafe { std::ptr::write_volatile((base + pg * step) as *mut u8, 0) };
                        if let Some(p) = progress.filter(|_| (pg - first) % 256 == 255) {
                            p.add(256 * step);
                        }
                    }
                    if let Some(p) = progress {
                        p.add((last - first) % 256 * step); // the pages after the last full 256
                    }
                });
            }
        });
    }

    /// Base address (aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }
    /// Usable length in bytes (the request rounded up to whole pages of the kind obtained).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Always false: a region has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// The alignment requested.
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// The page kind obtained.
    pub fn page_kind(&self) -> PageKind {
        self.kind
    }
    /// Why the region got less than the caller asked for, if it did.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// Registers the region with the CUDA driver in chunks of at most `max_chunk` bytes whose boundaries are
    /// multiples of `granularity` (so no page of that size straddles two registrations), using up to
    /// `threads` threads, on CUDA device ordinal `device` (registrations are portable to every context). Returns the number of chunks. Registering twice is an error.
    pub fn register_cuda(
        &self,
        device: i32,
        granularity: usize,
        max_chunk: usize,
        threads: usize,
        progress: Option<&Progress>,
    ) -> Result<usize> {
        let chunks = registration_chunks(self.len, granularity, max_chunk)?;
        let mut regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
        if !regs.is_empty() {
            return Err(Error::arg("pin", "region is already registered with CUDA"));
        }
        let n = chunks.len();
        if let Some(p) = progress {
            p.start(self.len);
        }
        *regs = crate::cuda::register_ranges(device, self.as_ptr(), &chunks, threads, progress)?;
        Ok(n)
    }

    /// Undoes [`Self::register_cuda`]; a no-op when not registered.
    pub fn unregister_cuda(&self) -> Result<()> {
        let mut regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
        let all = std::mem::take(&mut *regs);
        crate::cuda::unregister_all(all)
    }

    /// `(offset, len)` of each CUDA registration, empty when unpinned.
    pub fn registered_chunks(&self) -> Vec<(usize, usize)> {
        let regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
        let base = self.as_ptr() as usize;
        regs.iter().map(|r| (r.addr() - base, r.len())).collect()
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // Unregister before unmapping: the driver must not keep pinned pages of a dead mapping. If the
        // driver refuses, leak the mapping rather than unmap memory it may still access.
        if let Err(e) = self.unregister_cuda() {
            eprintln!(
                "kvtier: leaking a {}-byte host mapping: CUDA unregister failed: {e}",
                self.map_len
            );
            return;
        }
        // [map_base, map_base+map_len) is the mapping this value owns; nothing refers to it any more
        // because every view holds an Arc to this region.
        // SAFETY: the mapping this value owns, which nothing refers to any more.
        unsafe { libc::munmap(self.map_base.as_ptr().cast(), self.map_len) };
    }
}

/// Threads to pre-fault `len` bytes: one per 256 MiB, at most the core count and 16.
pub fn default_prefault_threads(len: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (len / (256 << 20)).clamp(1, cores.min(16))
}

/// Splits `[0, len)` into chunks of at most `max_chunk` bytes whose boundaries are multiples of
/// `granularity`. The last chunk takes the remainder.
pub fn registration_chunks(
    len: usize,
    granularity: usize,
    max_chunk: usize,
) -> Result<Vec<(usize, usize)>> {
    if granularity == 0 {
        return Err(Error::arg("granularity", "must be positive, got 0"));
    }
    if max_chunk < granularity {
        return Err(Error::arg(
            "register_chunk_bytes",
            format!("{max_chunk} is smaller than one page of {granularity} bytes"),
        ));
    }
    let step = max_chunk / granularity * granularity;
    let mut out = Vec::with_capacity(len.div_ceil(step));
    let mut off = 0;
    while off < len {
        let n = step.min(len - off);
        out.push((off, n));
        off += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(a: usize, h: HugePages) -> RegionOptions {
        RegionOptions {
            alignment: a,
            huge_pages: h,
            prefault_threads: Some(2),
            progress: None,
        }
    }

    #[test]
    fn aligned_and_rounded() {
        for &a in &[4096usize, 8192, 1 << 16, 1 << 21, 1 << 22] {
            for &n in &[1usize, 4095, 4096, 4097, 3 << 20] {
                let r = HostRegion::new(n, &opts(a, HugePages::Off)).unwrap();
                assert_eq!(r.as_ptr() as usize % a, 0, "alignment {a} size {n}");
                assert!(r.len() >= n && r.len() % 4096 == 0);
                assert_eq!(r.page_kind(), PageKind::Base);
                // The whole range is writable and zeroed.
                // SAFETY: the region owns [ptr, ptr+len).
                let s = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), r.len()) };
                assert!(s.iter().all(|&b| b == 0));
                s[r.len() - 1] = 7;
            }
        }
    }

    #[test]
    fn rejects_bad_arguments() {
        let e = HostRegion::new(0, &RegionOptions::default()).unwrap_err();
        assert!(e.to_string().contains("`nbytes`"), "{e}");
        for a in [0usize, 1000, 2048, 4097, 12288] {
            let e = HostRegion::new(4096, &opts(a, HugePages::Off)).unwrap_err();
            assert!(e.to_string().contains("`alignment`"), "{e}");
        }
        let e = HostRegion::new(usize::MAX, &RegionOptions::default()).unwrap_err();
        assert!(e.to_string().contains("`nbytes`"), "{e}");
        assert!(HugePages::parse("yes")
            .unwrap_err()
            .to_string()
            .contains("huge_pages"));
    }

    #[test]
    fn huge_page_fallback_is_reported() {
        // Auto never fails; when it gets less than explicit pages it says why.
        let r = HostRegion::new(5 << 20, &opts(4096, HugePages::Auto)).unwrap();
        match r.page_kind() {
            PageKind::Explicit => assert!(r.fallback().is_none()),
            _ => assert!(r.fallback().is_some()),
        }
        if r.page_kind() != PageKind::Base {
            assert_eq!(r.as_ptr() as usize % HUGE_PAGE, 0);
            assert_eq!(r.len() % HUGE_PAGE, 0);
        }
        // Required fails cleanly where the system has no explicit huge pages.
        let nr = std::fs::read_to_string("/proc/sys/vm/nr_hugepages").unwrap_or_default();
        if nr.trim() == "0" {
            let e = HostRegion::new(2 << 20, &opts(4096, HugePages::Required)).unwrap_err();
            assert!(matches!(e, Error::HugePagesUnavailable(_)), "{e}");
        }
    }

    #[test]
    fn concurrent_create_drop() {
        std::thread::scope(|s| {
            for t in 0..8 {
                s.spawn(move || {
                    for i in 0..20 {
                        let r =
                            HostRegion::new((t + 1) * (i + 1) * 65536, &RegionOptions::default())
                                .unwrap();
                        // SAFETY: inside the region.
                        unsafe { *r.as_ptr().add(r.len() - 1) = t as u8 };
                    }
                });
            }
        });
    }

    #[test]
    fn chunks_respect_granularity() {
        let c = registration_chunks(10 * 3000, 3000, 7000).unwrap();
        assert_eq!(
            c,
            vec![
                (0, 6000),
                (6000, 6000),
                (12000, 6000),
                (18000, 6000),
                (24000, 6000)
            ]
        );
        let c = registration_chunks(10_000, 3000, 1 << 30).unwrap();
        assert_eq!(c, vec![(0, 10_000)]);
        assert!(registration_chunks(10, 3000, 2000).is_err());
        assert!(registration_chunks(10, 0, 2000).is_err());
    }

    #[test]
    fn unpinned_region_has_no_registrations() {
        let r = HostRegion::new(1 << 20, &RegionOptions::default()).unwrap();
        assert!(r.registered_chunks().is_empty());
        r.unregister_cuda().unwrap();
    }
}

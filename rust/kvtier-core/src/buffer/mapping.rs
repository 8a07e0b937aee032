//! Mapping a region: an anonymous `mmap` trimmed to the alignment asked for, on explicit or transparent
//! huge pages where the policy and the system allow, and why it got less when it did.

use std::ptr::NonNull;
use std::sync::Mutex;

use super::{HostRegion, HugePages, PageKind, RegionOptions, BASE_PAGE, HUGE_PAGE, MIN_ALIGNMENT};
use crate::error::{Error, Result};

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
}

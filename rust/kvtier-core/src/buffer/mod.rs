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

mod mapping;
mod prefault;
mod registration;
#[cfg(test)]
mod tests;

use std::ptr::NonNull;
use std::sync::Mutex;

use crate::cuda::Registration;
use crate::error::{Error, Result};
pub use crate::progress::Progress;
pub use prefault::default_prefault_threads;
pub use registration::registration_chunks;

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

impl HostRegion {
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

//! Pre-faulting: every page of a new region touched by a few threads, so the first copy into it never
//! page-faults on a hot path.

use super::{HostRegion, PageKind, Progress, RegionOptions, BASE_PAGE, HUGE_PAGE};
use crate::error::Result;

impl HostRegion {
    pub(super) fn finish(self, opts: &RegionOptions) -> Result<Self> {
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
}

/// Threads to pre-fault `len` bytes: one per 256 MiB, at most the core count and 16.
pub fn default_prefault_threads(len: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (len / (256 << 20)).clamp(1, cores.min(16))
}

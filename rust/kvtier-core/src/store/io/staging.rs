//! The store's staging pages: slots of memory of its own, of the bound pool's page geometry, that a page
//! batch reads into or writes from instead of the pool's pages ([`Pages::Staging`]), and the copies between
//! the two. A caller that must be able to walk away from a batch still in flight (a deadline) moves the
//! pages through staging slots it owns: a read is copied into the pool only once it has returned in time, a
//! write's pages are copied out of the pool before its IO starts. The pool's memory is then never touched
//! by IO nobody waits for any more; a late batch only ever touches staging slots, which the caller keeps
//! out of use until it returns.

use super::pages::{PageLayout, Pages};
use crate::alloc::page_starts;
use crate::error::{Error, Result};
use crate::store::Shared;

/// Copies of at least this many bytes are shared among threads.
const PARALLEL_COPY_BYTES: u64 = 16 << 20;
/// At most this many threads copy one batch.
const COPY_THREADS: usize = 4;

impl Shared {
    /// Binds the staging pages: `layout` of the pool's object sizes and page tokens, sharing no byte with
    /// the pool. Rebinding replaces them (the caller no longer uses the old slots).
    ///
    /// # Safety
    /// As [`Shared::bind_pages`], for every staging page.
    pub unsafe fn bind_staging(&self, layout: PageLayout) -> Result<()> {
        layout.check()?;
        // (held while the pool is checked: a pool bound meanwhile unbinds these pages after, never before)
        let mut bound = self
            .pages
            .staging
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let pool = self.layout_of(Pages::Pool)?;
        if (layout.k_len, layout.v_len, layout.page_tokens)
            != (pool.k_len, pool.v_len, pool.page_tokens)
        {
            return Err(Error::arg(
                "staging",
                format!("staging pages must have the pool's object sizes and page tokens: {layout:?} for {pool:?}"),
            ));
        }
        let spans = |l: &PageLayout| -> Vec<(usize, usize)> {
            (0..l.per_page())
                .map(|side| {
                    let (base, stride, len) = if side == 0 {
                        (l.k_base, l.k_stride, l.k_len)
                    } else {
                        (l.v_base, l.v_stride, l.v_len)
                    };
                    (base, base + (l.pages - 1) * stride + len as usize) // (checked by `check`)
                })
                .collect()
        };
        for (a0, a1) in spans(&layout) {
            if spans(&pool).iter().any(|&(b0, b1)| a0 < b1 && b0 < a1) {
                return Err(Error::arg(
                    "staging",
                    "staging pages overlap the bound pool's pages",
                ));
            }
        }
        *bound = Some(layout);
        Ok(())
    }

    /// Copies whole pages between the pool and the staging pages: pool page of `host_indices[i]` to the
    /// staging page of `staging_indices[i]` (or back, `to_pool`). Both are token slots, whole pages in the
    /// same order; destinations distinct. Every argument is checked before a byte moves; the ranges are
    /// claimed against the store's batches in flight (a copy waits for a batch that writes its sources or
    /// touches its destinations).
    pub fn copy_pages(
        &self,
        to_pool: bool,
        host_indices: &[i64],
        staging_indices: &[i64],
    ) -> Result<()> {
        let pool = self.layout_of(Pages::Pool)?;
        let st = self.layout_of(Pages::Staging)?;
        if (st.k_len, st.v_len, st.page_tokens) != (pool.k_len, pool.v_len, pool.page_tokens) {
            return Err(Error::arg(
                "staging",
                "the staging pages are not of the bound pool's geometry (bind_staging again)",
            ));
        }
        let p = page_starts(host_indices, pool.page_tokens, pool.pages, "host_indices")?;
        let s = page_starts(staging_indices, st.page_tokens, st.pages, "staging_indices")?;
        if p.len() != s.len() {
            return Err(Error::arg(
                "staging_indices",
                format!("{} staging pages for {} pool pages", s.len(), p.len()),
            ));
        }
        let (dst_pages, dst_len, name) = if to_pool {
            (&p, pool.pages, "host_indices")
        } else {
            (&s, st.pages, "staging_indices")
        };
        let mut seen = vec![false; dst_len];
        for &d in dst_pages {
            if std::mem::replace(&mut seen[d], true) {
                return Err(Error::arg(
                    name,
                    format!("page {d} appears twice: two pages would be copied into it"),
                ));
            }
        }
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for (&a, &b) in p.iter().zip(&s) {
            for (x, y) in pool.objects(a).zip(st.objects(b)) {
                let (from, to) = if to_pool { (y, x) } else { (x, y) };
                src.push(from);
                dst.push(to);
            }
        }
        let _claims = self.claim_sides([(src.clone(), false), (dst.clone(), true)]);
        // Every range lies inside the bound pool or the bound staging pages (page numbers checked against
        // them above), which their bind contracts keep alive; the two share no byte (checked at bind) and the
        // destinations are distinct pages, whose K and V never share a byte (checked at bind), so no
        // destination overlaps a source or another destination; the claims keep every other batch of this
        // store off the destinations and from writing the sources while the copy runs.
        // SAFETY: as just said.
        unsafe { copy_all(&src, &dst) };
        Ok(())
    }
}

/// Copies `src[i]` to `dst[i]` (`(address, length)`, equal lengths), on up to [`COPY_THREADS`] threads.
///
/// # Safety
/// Every source readable and every destination writable for its length, no destination overlapping a
/// source or another destination, nothing else writing any of them meanwhile.
unsafe fn copy_all(src: &[(usize, u64)], dst: &[(usize, u64)]) {
    assert!(
        src.len() == dst.len() && src.iter().zip(dst).all(|(s, d)| s.1 == d.1),
        "copy_all: every source and its destination must have one length"
    );
    let total: u64 = src.iter().map(|s| s.1).sum();
    let threads = if total >= PARALLEL_COPY_BYTES {
        COPY_THREADS.min(src.len()).max(1)
    } else {
        1
    };
    let copy = |range: std::ops::Range<usize>| {
        for i in range {
            // SAFETY: this function's contract, for pair i.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src[i].0 as *const u8,
                    dst[i].0 as *mut u8,
                    src[i].1 as usize,
                )
            };
        }
    };
    if threads == 1 {
        copy(0..src.len());
        return;
    }
    let per = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for t in 1..threads {
            let range = (t * per).min(src.len())..((t + 1) * per).min(src.len());
            scope.spawn(move || copy(range));
        }
        copy(0..per.min(src.len()));
    });
}

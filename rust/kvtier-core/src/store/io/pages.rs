//! Page-level batches: a store bound to one host pool's page layout pairs each page's K and V objects and
//! computes their addresses; range claims order batches from several threads that touch the same host
//! memory.

use std::sync::{Condvar, Mutex, RwLock};

use super::seal_io::SealKeys;
use crate::error::{Error, Result};
use crate::store::index::{Entry, Index};
use crate::store::Shared;

/// Where a host pool's pages live: page `p`'s K object is `k_len` bytes at `k_base + p·k_stride`, its V
/// object `v_len` bytes at `v_base + p·v_stride`; `page_tokens` token slots make a page, `pages` pages
/// make the pool. `v_len == 0`: one object per page (an MLA pool's latent KV), stored as `<key>.kv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLayout {
    /// Address of page 0's K object.
    pub k_base: usize,
    /// Bytes from one page's K object to the next.
    pub k_stride: usize,
    /// Bytes of one page's K object.
    pub k_len: u64,
    /// Address of page 0's V object.
    pub v_base: usize,
    /// Bytes from one page's V object to the next.
    pub v_stride: usize,
    /// Bytes of one page's V object.
    pub v_len: u64,
    /// Token slots per page.
    pub page_tokens: usize,
    /// Pages in the pool.
    pub pages: usize,
}

impl PageLayout {
    /// Objects per page: 2 (K and V), or 1 (`v_len == 0`).
    pub fn per_page(&self) -> usize {
        if self.v_len == 0 {
            1
        } else {
            2
        }
    }

    /// `(address, length)` of page `p`'s objects (K then V, or the one object). `p < pages`.
    pub(in crate::store) fn objects(&self, p: usize) -> impl Iterator<Item = (usize, u64)> + '_ {
        [
            (self.k_base + p * self.k_stride, self.k_len),
            (self.v_base + p * self.v_stride, self.v_len),
        ]
        .into_iter()
        .take(self.per_page())
    }

    /// The object names of page `key`.
    fn names<'k>(&self, key: &'k str) -> impl Iterator<Item = String> + 'k {
        let sides: &'static [&'static str] = if self.per_page() == 1 {
            &["kv"]
        } else {
            &["k", "v"]
        };
        sides.iter().map(move |s| format!("{key}.{s}"))
    }

    /// Checks the layout's own arithmetic: non-empty objects that fit their stride, no overflow.
    pub(in crate::store) fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::arg("pool", why));
        if self.pages == 0 || self.page_tokens == 0 {
            return bad(format!("a pool needs pages and page tokens, got {self:?}"));
        }
        let sides = [
            (self.k_base, self.k_stride, self.k_len),
            (self.v_base, self.v_stride, self.v_len),
        ];
        for &(base, stride, len) in &sides[..self.per_page()] {
            let end = (self.pages - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(base))
                .and_then(|x| x.checked_add(usize::try_from(len).ok()?));
            if len == 0 || (self.pages > 1 && (len as u128) > stride as u128) || end.is_none() {
                return bad(format!("page objects must be non-empty, fit their stride and the address space: {self:?}"));
            }
        }
        if self.per_page() == 1 {
            return Ok(());
        }
        // K and V objects must never share a byte: separate spans, or one stride with K and V side by side
        let span = |base: usize, stride: usize, len: u64| {
            (base, base + (self.pages - 1) * stride + len as usize)
        };
        let (k0, k1) = span(self.k_base, self.k_stride, self.k_len);
        let (v0, v1) = span(self.v_base, self.v_stride, self.v_len);
        let apart = k1 <= v0 || v1 <= k0;
        let side_by_side = self.k_stride == self.v_stride && {
            let (a, b) = if self.k_base <= self.v_base {
                ((self.k_base, self.k_len), (self.v_base, self.v_len))
            } else {
                ((self.v_base, self.v_len), (self.k_base, self.k_len))
            };
            let d = (b.0 - a.0) as u128;
            d >= a.1 as u128 && d + b.1 as u128 <= self.k_stride as u128
        };
        if !apart && !side_by_side {
            return bad(format!("K and V objects of the pool overlap: {self:?}"));
        }
        Ok(())
    }
}

/// The ranges a batch reads or writes, claimed against the other batches in flight.
#[derive(Default)]
pub(in crate::store) struct Bound {
    layout: RwLock<Option<PageLayout>>,
    /// The store's own staging pages (see `staging.rs`), of the pool's page geometry.
    pub(in crate::store) staging: RwLock<Option<PageLayout>>,
    busy: Mutex<Busy>,
    idle: Condvar,
}

/// `(start, len)` host ranges of one batch, sorted by start.
type Ranges = Vec<(usize, usize)>;
/// A page batch's object names, their `(address, length)`, and the objects per page.
type Objects = (Vec<String>, Vec<(usize, u64)>, usize);

#[derive(Default)]
struct Busy {
    next: u64,
    /// (batch id, whether it writes host memory, its ranges)
    batches: Vec<(u64, bool, Ranges)>,
}

/// Whether two start-sorted lists of `(start, len)` ranges share a byte.
pub fn overlap(a: &[(usize, usize)], b: &[(usize, usize)]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        if x.0 < y.0.saturating_add(y.1) && y.0 < x.0.saturating_add(x.1) {
            return true;
        }
        if x.0.saturating_add(x.1) <= y.0.saturating_add(y.1) {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

/// A batch's claim on its host ranges; released on drop.
pub struct Claim<'a> {
    bound: &'a Bound,
    id: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut b = self.bound.busy.lock().unwrap_or_else(|p| p.into_inner());
        b.batches.retain(|(id, _, _)| *id != self.id);
        self.bound.idle.notify_all();
    }
}

/// Which pages a batch's token slots name: the bound host pool's, or the store's staging pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pages {
    /// The host pool bound with `bind_pages`.
    Pool,
    /// The staging pages bound with `bind_staging`.
    Staging,
}

/// What a page batch names: keys and the host-pool token slots (`page_tokens` per key) of their pages.
pub struct PageBatch<'a> {
    /// Page keys; the store's objects are `<key>.k` and `<key>.v`.
    pub keys: &'a [String],
    /// Token slots, whole pages in key order.
    pub host_indices: &'a [i64],
}

impl Shared {
    /// Waits until no batch in flight conflicts with `objs`' ranges (a writer conflicts with any overlap,
    /// readers only with writers), then claims them. Each batch claims all its ranges at once, so claims
    /// cannot deadlock; call it without holding locks another batch needs to finish.
    pub fn claim(&self, objs: &[(&str, usize, u64)], writes: bool) -> Claim<'_> {
        let ranges = objs.iter().map(|&(_, p, n)| (p, n)).collect();
        let [claim] = self.claim_sides([(ranges, writes)]);
        claim
    }

    /// Claims several sides at once (`(ranges, writes)` each: a copy's sources and its destinations), as
    /// [`Shared::claim`] claims one: all of them in one step, so claims cannot deadlock.
    pub(in crate::store) fn claim_sides<const N: usize>(
        &self,
        sides: [(Vec<(usize, u64)>, bool); N],
    ) -> [Claim<'_>; N] {
        let sides = sides.map(|(objs, writes)| {
            let mut ranges: Ranges = objs
                .into_iter()
                .map(|(p, n)| (p, usize::try_from(n).unwrap_or(usize::MAX)))
                .collect();
            ranges.sort_unstable();
            (ranges, writes)
        });
        let bound = &self.pages;
        let mut b = bound.busy.lock().unwrap_or_else(|p| p.into_inner());
        while sides.iter().any(|(ranges, writes)| {
            b.batches
                .iter()
                .any(|(_, w, rs)| (*w || *writes) && overlap(rs, ranges))
        }) {
            b = bound.idle.wait(b).unwrap_or_else(|p| p.into_inner());
        }
        sides.map(|(ranges, writes)| {
            let id = b.next;
            b.next += 1;
            b.batches.push((id, writes, ranges));
            Claim { bound, id }
        })
    }

    /// Binds the host pool whose pages [`PageStore::put_pages`] and [`PageStore::get_pages`] read and
    /// write. Rebinding replaces the layout and unbinds the staging pages (bound again for the new pool's
    /// geometry, checked against it).
    ///
    /// # Safety
    /// For every page `p < layout.pages`, both of its objects' ranges must be memory that stays alive and
    /// mapped until the store is dropped or bound to another layout, that a `put_pages` may read and a
    /// `get_pages` may write while their batch is in flight (the caller orders its own accesses to those
    /// pages against the batches it issues).
    pub unsafe fn bind_pages(&self, layout: PageLayout) -> Result<()> {
        layout.check()?;
        // (staging pages were checked against the old pool: sizes and overlap no longer hold)
        let mut staging = self
            .pages
            .staging
            .write()
            .unwrap_or_else(|p| p.into_inner());
        *self.pages.layout.write().unwrap_or_else(|p| p.into_inner()) = Some(layout);
        *staging = None;
        Ok(())
    }

    /// The bound layout, if any.
    pub fn page_layout(&self) -> Option<PageLayout> {
        *self.pages.layout.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The bound layout of `which` pages, or an error naming what is missing.
    pub(in crate::store) fn layout_of(&self, which: Pages) -> Result<PageLayout> {
        let (l, what) = match which {
            Pages::Pool => (
                self.page_layout(),
                "no host pool is bound to this store (register_mem_pool_host first)",
            ),
            Pages::Staging => (
                *self.pages.staging.read().unwrap_or_else(|p| p.into_inner()),
                "no staging pages are bound to this store (bind_staging first)",
            ),
        };
        l.ok_or_else(|| Error::arg("pool", what))
    }

    /// Objects of a page batch, every page proven inside the bound pool (and distinct when `writes`).
    fn page_objects(&self, batch: &PageBatch<'_>, writes: bool, which: Pages) -> Result<Objects> {
        let l = self.layout_of(which)?;
        let pages =
            crate::alloc::page_starts(batch.host_indices, l.page_tokens, l.pages, "host_indices")?;
        if pages.len() != batch.keys.len() {
            return Err(Error::arg(
                "host_indices",
                format!(
                    "{} slots for {} keys of {}-token pages (expected {})",
                    batch.host_indices.len(),
                    batch.keys.len(),
                    l.page_tokens,
                    batch.keys.len() * l.page_tokens
                ),
            ));
        }
        if writes {
            let mut seen = vec![false; l.pages];
            for &p in &pages {
                if std::mem::replace(&mut seen[p], true) {
                    return Err(Error::arg(
                        "host_indices",
                        format!(
                            "page {p} appears twice: two pages would be read into the same memory"
                        ),
                    ));
                }
            }
        }
        let mut names = Vec::with_capacity(2 * pages.len());
        let mut ranges = Vec::with_capacity(2 * pages.len());
        for (k, &p) in batch.keys.iter().zip(&pages) {
            Self::check_key(k)?;
            names.extend(l.names(k));
            ranges.extend(l.objects(p)); // p < l.pages: checked by page_starts
        }
        Ok((names, ranges, l.per_page()))
    }

    /// Stores whole pages from the bound pool; per key, whether its K and V objects are both durably
    /// stored. IO errors are results, never raised. A page that got only one of its objects keeps it: it
    /// is a miss until a later put writes the page again, whole (both objects, in one commit: never a new
    /// K beside an old V), and eviction takes both together.
    pub fn put_pages(&self, batch: &PageBatch<'_>) -> Result<Vec<bool>> {
        self.page_io(batch, false, None, Pages::Pool)
    }

    /// [`Shared::put_pages`] or [`Shared::get_pages`] (`reads`) of `which` pages: the batch's token slots
    /// name staging pages with [`Pages::Staging`].
    pub fn page_batch(
        &self,
        batch: &PageBatch<'_>,
        reads: bool,
        which: Pages,
    ) -> Result<Vec<bool>> {
        self.page_io(batch, reads, None, which)
    }

    /// Reads whole pages into the bound pool; per key, whether K and V were both found with the pool's
    /// sizes and verified (a False page's host bytes are unspecified).
    pub fn get_pages(&self, batch: &PageBatch<'_>) -> Result<Vec<bool>> {
        self.page_io(batch, true, None, Pages::Pool)
    }

    /// As [`Shared::get_pages`], the first `first_layers` of the pool's `layers` of every page before the
    /// rest (a page's K and V hold their layers in order: `page_first_direct`): `between()` is called once
    /// they are all in memory (not yet checked), then the rest is read and every page checked whole (see
    /// [`Shared::get_in_two`]). A split restore loads those layers to the GPU while the rest is read.
    /// `between` is called exactly once, on every path.
    pub fn get_pages_in_two(
        &self,
        batch: &PageBatch<'_>,
        layers: usize,
        first_layers: usize,
        between: &mut dyn FnMut(),
    ) -> Result<Vec<bool>> {
        if layers == 0 || first_layers == 0 || first_layers >= layers {
            between();
            return Err(Error::arg(
                "first_layers",
                format!("{first_layers} of {layers} layers (expected 0 < first_layers < layers)"),
            ));
        }
        self.page_io(
            batch,
            true,
            Some((layers as u64, first_layers as u64, between)),
            Pages::Pool,
        )
    }

    /// One page batch: objects of pages proven inside the bound pool (distinct pages when `writes`), their
    /// host ranges claimed against the other batches of this store, then `get` or `put`; per page, whether
    /// every object of it went through. `split` (a get): `(layers, first, between)` of `get_pages_in_two`.
    fn page_io(
        &self,
        batch: &PageBatch<'_>,
        writes: bool,
        split: Option<(u64, u64, &mut dyn FnMut())>,
        which: Pages,
    ) -> Result<Vec<bool>> {
        let mut split = split;
        let found = self.page_objects(batch, writes, which);
        let (names, ranges, per) = match found {
            Ok(x) => x,
            Err(e) => {
                if let Some((_, _, between)) = split.as_mut() {
                    between();
                }
                return Err(e);
            }
        };
        let objs: Vec<(&str, usize, u64)> = names
            .iter()
            .zip(&ranges)
            .map(|(n, r)| (n.as_str(), r.0, r.1))
            .collect();
        let _claim = self.claim(&objs, writes);
        // Every range lies inside the bound pool (page numbers checked against it), which the bind contract
        // keeps alive and readable/writable. For a get the pages are distinct (checked) and a page's K and
        // V never share a byte (checked at bind), so no two destinations overlap; while the claim is held no
        // other batch of this store writes a range this one touches, or touches a range this one writes.
        let ok = if let Some((layers, first, between)) = split {
            if objs.iter().any(|o| o.2 % layers != 0) {
                // not `layers` layers in order (a layout this was not made for): one pass, then `between`
                // SAFETY: as for `get` below.
                let got = unsafe { self.get(&objs) };
                between();
                got?
            } else {
                // each object's first layers, rounded up to whole 4 KiB blocks (O_DIRECT stays on; the
                // rounding only reads a little of the next layer early)
                let prefix: Vec<u64> = objs
                    .iter()
                    .map(|o| {
                        (o.2 / layers * first)
                            .div_ceil(4096)
                            .saturating_mul(4096)
                            .min(o.2)
                    })
                    .collect();
                // SAFETY: as for `get` below.
                unsafe { self.get_in_two(&objs, &prefix, between) }?
            }
        } else if writes {
            // SAFETY: live, disjoint destinations in the bound pool, claimed for this batch (see above).
            unsafe { self.get(&objs) }?
        } else {
            // SAFETY: live sources in the bound pool that no batch of this store writes meanwhile.
            unsafe { self.put_whole(&objs, per) }?
        };
        Ok(ok.chunks_exact(per).map(|p| p.iter().all(|&x| x)).collect())
    }

    /// The leading run of keys whose page (every object) is stored; 0 before a pool is bound.
    pub fn pages_exist(&self, keys: &[String]) -> usize {
        let Some(l) = self.page_layout() else {
            return 0;
        };
        let names: Vec<String> = keys.iter().flat_map(|k| l.names(k)).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let ex = self.exists(&refs);
        ex.chunks_exact(l.per_page())
            .take_while(|p| p.iter().all(|&x| x))
            .count()
    }

    /// Deletes whole pages (every object of each); returns how many pages had any object. Durable when it
    /// returns; on an error nothing was deleted.
    pub fn delete_pages(&self, keys: &[String]) -> Result<usize> {
        let l = self.page_layout().ok_or_else(|| {
            Error::arg(
                "pool",
                "no host pool is bound to this store (register_mem_pool_host first)",
            )
        })?;
        let names: Vec<String> = keys.iter().flat_map(|k| l.names(k)).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let had: usize = self
            .exists(&refs)
            .chunks_exact(l.per_page())
            .filter(|p| p.iter().any(|&x| x))
            .count();
        self.delete(&refs)?;
        Ok(had)
    }
}

/// Per object of `objs` (pages of `per` consecutive objects), whether it is stored and servable as it is:
/// only when every object of its page is (a page is its objects written together: one that holds only some
/// of them is written whole, never a new K beside an old V). An object stored in clear never stands for a
/// sealed one, nor the reverse, nor one sealed under a tenant key since destroyed for one under its current
/// key.
pub(in crate::store) fn stored_pages(
    ix: &Index,
    objs: &[(&str, usize, u64)],
    per: usize,
    keys: Option<&SealKeys>,
) -> Vec<bool> {
    let current = |k: &str, e: &Entry| match keys {
        Some(keys) => keys.current(k, e.seal.as_deref()),
        None => e.seal.is_none(),
    };
    let mut have: Vec<bool> = objs
        .iter()
        .map(|o| ix.get(o.0).is_some_and(|e| current(o.0, e)))
        .collect();
    if per > 1 && objs.len().is_multiple_of(per) {
        for page in have.chunks_exact_mut(per) {
            let whole = page.iter().all(|&x| x);
            page.fill(whole);
        }
    }
    have
}

/// Indices of objects written (`written`) whose page (`per` consecutive objects) is not written whole: some
/// other object of it was to be written (not already stored: `stored` false) and was not. Empty for pages of
/// one object.
pub(in crate::store) fn torn_pages(
    written: impl Iterator<Item = usize>,
    stored: &[bool],
    per: usize,
) -> std::collections::HashSet<usize> {
    let written: std::collections::HashSet<usize> = written.collect();
    if per <= 1 || !stored.len().is_multiple_of(per) {
        return Default::default();
    }
    let mut torn = std::collections::HashSet::new();
    for page in (0..stored.len()).step_by(per) {
        let objs = page..page + per;
        if objs.clone().any(|i| !stored[i] && !written.contains(&i)) {
            torn.extend(objs.filter(|i| written.contains(i)));
        }
    }
    torn
}

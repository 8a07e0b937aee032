//! The host memory a store may read and write: ranges registered by the caller, each kept alive by an owner
//! for as long as the store lives, and the checks that every object range and the bound pool lie inside
//! them before a byte moves.

use std::any::Any;
use std::sync::Arc;

use crate::buffer::HostRegion;
use crate::error::{Error, Result};
use crate::store::{PageLayout, Shared};

/// Registered memory (see the module docs): the core's one registry type.
pub(in crate::store) type Memory = crate::ranges::Ranges;

impl Shared {
    /// Allows IO into and out of `region`, which the store keeps mapped until it is dropped.
    pub fn register_region(&self, region: Arc<HostRegion>) {
        self.memory.register_region(region);
    }

    /// Allows IO into and out of `[ptr, ptr + len)`, memory the caller does not own through kvtier (an
    /// engine's own host pool); the store holds `owner` until it is dropped.
    ///
    /// # Safety
    /// The range must be live, readable and writable host memory for as long as `owner` is alive, and the
    /// caller orders its own accesses to it against the batches it issues.
    pub unsafe fn register_foreign(
        &self,
        ptr: usize,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    ) {
        // SAFETY: the same contract, passed on.
        unsafe { self.memory.register_foreign(ptr, len, owner) };
    }

    /// Stores objects given as `(key, address, length)`, every range inside registered memory (checked
    /// before any IO); per object, whether it is durably stored.
    pub fn put_objects(&self, objs: &[(&str, usize, u64)]) -> Result<Vec<bool>> {
        self.objects(objs, false)
    }

    /// Reads objects into `(key, address, length)` ranges inside registered memory, pairwise disjoint
    /// (checked before any IO); per object, whether it was found and verified.
    pub fn get_objects(&self, objs: &[(&str, usize, u64)]) -> Result<Vec<bool>> {
        self.objects(objs, true)
    }

    fn objects(&self, objs: &[(&str, usize, u64)], writes: bool) -> Result<Vec<bool>> {
        let held = self.memory.snapshot(); // registered memory stays alive with the store (and `held`)
        let spans: Vec<(usize, u64)> = objs.iter().map(|o| (o.1, o.2)).collect();
        held.check("host_indices", &spans, writes)?;
        let _claim = self.claim(objs, writes);
        // every range lies inside registered memory that `held` keeps alive for the call; written ranges do
        // not overlap each other; and while the claim is held no other batch of this store writes a range
        // this one touches, or touches a range this one writes (memory the engine itself writes, e.g. a
        // device -> host backup into the same pages, is the caller's to order).
        if writes {
            // SAFETY: live, disjoint destinations that no other batch of this store touches meanwhile.
            unsafe { self.get(objs) }
        } else {
            // SAFETY: live sources that no batch of this store writes meanwhile.
            unsafe { self.put(objs) }
        }
    }

    /// Binds the host pool whose pages `put_pages` / `get_pages` move, after checking that every page's
    /// objects lie inside one registered range (pages are affine in the page number: the first and the last
    /// page of each side inside one range puts every page there).
    pub fn bind_registered(&self, layout: PageLayout) -> Result<()> {
        self.check_registered(&layout, "pool")?;
        // every page's objects lie inside registered memory (checked above), which the store keeps alive
        // until it is dropped (registrations are never removed).
        // SAFETY: bind_pages' contract: every page inside memory that outlives the binding.
        unsafe { self.bind_pages(layout) }
    }

    /// Binds the store's staging pages (see `staging.rs`) after the same check as [`Shared::bind_registered`].
    pub fn bind_staging_registered(&self, layout: PageLayout) -> Result<()> {
        self.check_registered(&layout, "staging")?;
        // SAFETY: bind_staging's contract, as for bind_registered above: registered memory outlives the store.
        unsafe { self.bind_staging(layout) }
    }

    /// Whether every page of `layout` lies inside one registered range per side (`what` names it in errors).
    fn check_registered(&self, layout: &PageLayout, what: &str) -> Result<()> {
        let held = self.memory.snapshot();
        let last = layout.pages.saturating_sub(1);
        let sides = [
            ("K", layout.k_base, layout.k_stride, layout.k_len),
            ("V", layout.v_base, layout.v_stride, layout.v_len),
        ];
        for &(side, base, stride, len) in &sides[..layout.per_page()] {
            let end = last
                .checked_mul(stride)
                .and_then(|x| x.checked_add(base))
                .ok_or_else(|| {
                    Error::arg(what, format!("{side} pages overflow the address space"))
                })?;
            // one range must hold the whole span of pages (first page's start to the last page's end)
            if !held.holds(base, (end - base) as u64 + len) {
                return Err(Error::arg(
                    what,
                    format!("the {side} objects of pages 0..{} are not inside one registered host buffer", layout.pages),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::{opts, payload, tmp, SERIAL};
    use crate::store::PageStore;

    #[test]
    fn objects_and_layouts_outside_registered_memory_are_refused_before_any_io() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let pool = Arc::new(payload(16, 8192, 3));
        let base = pool.as_ptr() as usize;
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        assert!(
            s.put_objects(&[("a", base, 4096)]).is_err(),
            "nothing registered yet"
        );
        s.register_region(pool.clone());
        s.register_region(pool.clone()); // once
        assert_eq!(s.memory.snapshot().len(), 1);
        assert_eq!(
            s.put_objects(&[("a", base, 4096), ("b", base + 4096, 4096)])
                .unwrap(),
            vec![true, true]
        );
        let end = base + pool.len();
        assert!(
            s.put_objects(&[("c", end - 4096, 8192)]).is_err(),
            "past the end"
        );
        assert!(
            s.get_objects(&[("a", base, 4096), ("b", base + 2048, 4096)])
                .is_err(),
            "overlapping reads"
        );
        assert!(!s.exists(&["c"])[0]);
        assert_eq!(
            s.get_objects(&[("a", base + 8192, 4096)]).unwrap(),
            vec![true]
        );
        let layout = PageLayout {
            k_base: base,
            k_stride: 8192,
            k_len: 8192,
            v_base: base + 65536,
            v_stride: 4096,
            v_len: 4096,
            page_tokens: 4,
            pages: 8,
        };
        s.bind_registered(layout).unwrap();
        assert!(
            s.bind_registered(PageLayout {
                pages: 100,
                ..layout
            })
            .is_err(),
            "pages past the region"
        );
    }
}

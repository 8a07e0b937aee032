//! Token-slot allocation over whole pages, with HiCache's semantics.
//!
//! A host pool of `page_num` pages of `page_size` tokens hands out token-slot indices. Requests are whole
//! pages (`n % page_size == 0`); the result is runs of whole pages, each page's first index a multiple of
//! `page_size` and its `page_size` indices consecutive. Pages come off the front of a free list that starts
//! as `0, 1, 2, …` and freed pages go to its back, as HiCache's allocator does, so allocation order is the
//! same for the same sequence of calls. Unlike HiCache, `free` checks what it is given: a double free, a
//! foreign index or a partial page is rejected and nothing is freed.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::error::{Error, Result};

/// A thread-safe page allocator (interior lock; every method takes `&self`).
#[derive(Debug)]
pub struct PageAllocator {
    page_size: usize,
    page_num: usize,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    free: VecDeque<u32>,
    used: Vec<bool>,
}

impl PageAllocator {
    /// An allocator over `page_num` pages of `page_size` tokens, all free.
    pub fn new(page_num: usize, page_size: usize) -> Result<Self> {
        if page_size == 0 {
            return Err(Error::arg("page_size", "must be positive, got 0"));
        }
        if page_num == 0 || page_num > u32::MAX as usize {
            return Err(Error::arg(
                "page_num",
                format!("must be in [1, 2^32), got {page_num}"),
            ));
        }
        if page_num
            .checked_mul(page_size)
            .is_none_or(|s| s > i64::MAX as usize)
        {
            return Err(Error::arg("page_num", "page_num * page_size overflows"));
        }
        Ok(Self {
            page_size,
            page_num,
            state: Mutex::new(State::fresh(page_num)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Number of pages.
    pub fn page_num(&self) -> usize {
        self.page_num
    }
    /// Free token slots.
    pub fn available(&self) -> usize {
        self.lock().free.len() * self.page_size
    }

    /// Allocates `n` token slots (whole pages). `Ok(None)` when fewer than `n` slots are free.
    pub fn alloc(&self, n: usize) -> Result<Option<Vec<i64>>> {
        if !n.is_multiple_of(self.page_size) {
            return Err(Error::arg(
                "need_size",
                format!("{n} is not a multiple of page_size {}", self.page_size),
            ));
        }
        let pages = n / self.page_size;
        let mut st = self.lock();
        if pages > st.free.len() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..pages {
            let p = st.free.pop_front().expect("checked length") as usize;
            st.used[p] = true;
            let first = (p * self.page_size) as i64;
            out.extend(first..first + self.page_size as i64);
        }
        Ok(Some(out))
    }

    /// Frees whole pages given as token-slot indices; returns the number of slots freed. Validates every
    /// page first: nothing is freed if any page is partial, out of range, freed twice, or not allocated.
    pub fn free(&self, indices: &[i64]) -> Result<usize> {
        let ps = self.page_size;
        let pages = page_starts(indices, ps, self.page_num, "indices")?;
        let mut st = self.lock();
        let mut seen = std::collections::HashSet::with_capacity(pages.len());
        for &p in &pages {
            if !st.used[p] || !seen.insert(p) {
                return Err(Error::arg(
                    "indices",
                    format!(
                        "page {p} (slots {}..{}) is not allocated (double free?)",
                        p * ps,
                        (p + 1) * ps
                    ),
                ));
            }
        }
        for &p in &pages {
            st.used[p] = false;
            st.free.push_back(p as u32);
        }
        Ok(indices.len())
    }

    /// True when token slot `slot`'s page is allocated.
    pub fn is_allocated(&self, slot: usize) -> bool {
        let p = slot / self.page_size;
        p < self.page_num && self.lock().used[p]
    }

    /// Frees everything and restores the initial free-list order.
    pub fn clear(&self) {
        *self.lock() = State::fresh(self.page_num);
    }
}

impl State {
    fn fresh(page_num: usize) -> Self {
        Self {
            free: (0..page_num as u32).collect(),
            used: vec![false; page_num],
        }
    }
}

/// Checks that `indices` are whole pages of a pool of `page_num` pages — length a multiple of `page_size`,
/// each group starting at a multiple of `page_size`, consecutive inside the group — and returns the page
/// numbers. `name` is the argument name used in errors.
pub fn page_starts(
    indices: &[i64],
    page_size: usize,
    page_num: usize,
    name: &str,
) -> Result<Vec<usize>> {
    let ps = page_size;
    if !indices.len().is_multiple_of(ps) {
        return Err(Error::arg(
            name,
            format!(
                "length {} is not a multiple of page_size {ps}",
                indices.len()
            ),
        ));
    }
    let limit = (page_num * ps) as i64;
    let mut out = Vec::with_capacity(indices.len() / ps);
    for (g, grp) in indices.chunks_exact(ps).enumerate() {
        let first = grp[0];
        if first < 0 || first >= limit {
            return Err(Error::arg(
                name,
                format!("{name}[{}] = {first} is out of range [0, {limit})", g * ps),
            ));
        }
        if first % ps as i64 != 0 {
            return Err(Error::arg(
                name,
                format!(
                    "{name}[{}] = {first} does not start a page (page_size {ps})",
                    g * ps
                ),
            ));
        }
        for (k, &v) in grp.iter().enumerate() {
            if v != first + k as i64 {
                return Err(Error::arg(
                    name,
                    format!(
                        "{name}[{}] = {v}: the {ps} slots of a page must be consecutive (expected {})",
                        g * ps + k,
                        first + k as i64
                    ),
                ));
            }
        }
        out.push((first / ps as i64) as usize);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_page_runs_in_hicache_order() {
        let a = PageAllocator::new(4, 2).unwrap();
        assert_eq!(a.alloc(4).unwrap().unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(a.alloc(2).unwrap().unwrap(), vec![4, 5]);
        assert_eq!(a.available(), 2);
        assert!(a.alloc(4).unwrap().is_none());
        assert_eq!(a.free(&[0, 1]).unwrap(), 2);
        // freed pages go to the back of the free list
        assert_eq!(a.alloc(4).unwrap().unwrap(), vec![6, 7, 0, 1]);
        assert!(a.alloc(3).is_err());
        a.clear();
        assert_eq!(a.available(), 8);
        assert_eq!(a.alloc(2).unwrap().unwrap(), vec![0, 1]);
    }

    #[test]
    fn free_rejects_and_changes_nothing() {
        let a = PageAllocator::new(4, 2).unwrap();
        let got = a.alloc(4).unwrap().unwrap();
        for bad in [
            vec![0i64],
            vec![1, 2],
            vec![0, 2],
            vec![8, 9],
            vec![-2, -1],
            vec![4, 5],
            vec![0, 1, 0, 1],
        ] {
            assert!(a.free(&bad).is_err(), "{bad:?}");
            assert_eq!(a.available(), 4);
        }
        a.free(&got).unwrap();
        assert!(a
            .free(&got)
            .unwrap_err()
            .to_string()
            .contains("double free"));
    }

    #[test]
    fn threads_never_share_a_page() {
        let a = PageAllocator::new(1000, 4).unwrap();
        let all: Vec<Vec<i64>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = Vec::new();
                        for _ in 0..100 {
                            let v = a.alloc(8).unwrap().unwrap();
                            mine.extend(v);
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut flat: Vec<i64> = all.concat();
        flat.sort();
        flat.dedup();
        assert_eq!(flat.len(), 3200);
    }
}

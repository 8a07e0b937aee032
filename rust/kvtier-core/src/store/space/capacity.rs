//! The limits a namespace's occupancy is kept within: its own `capacity_bytes` and, with a budget for the
//! whole store directory, what the other namespaces leave of it (`budget`; docs/STORE.md, "One budget for
//! a store directory"); eviction to those limits at open.

use std::sync::atomic::Ordering;

use crate::store::index::Index;
use crate::store::Shared;

impl Shared {
    /// The occupancy this namespace may have now: its capacity, and within the root's budget what the
    /// other namespaces' claims leave.
    pub(in crate::store) fn limit(&self) -> u64 {
        let room = self.share.as_ref().map_or(u64::MAX, |s| s.room());
        self.opts.capacity_bytes.min(room / 4096 * 4096)
    }

    /// Whether an occupancy of `total` fits the capacity and the root's budget; if it does, it is claimed
    /// in the root's table before the caller grows (index lock held through `_ix`, so the claim and the
    /// growth it allows are one step for this namespace).
    pub(in crate::store) fn fits(&self, _ix: &Index, total: u64) -> bool {
        total <= self.opts.capacity_bytes && self.share.as_ref().is_none_or(|s| s.claim(total))
    }

    /// Before a put: a namespace over its limit (the root's budget lowered, or another namespace waiting
    /// for its fair share) evicts and gives blocks back down to it first.
    pub(in crate::store) fn keep_to_limit(&self) {
        if self.share.is_some() && self.log.index().occupancy_with(0, 0) > self.limit() {
            self.evict_to_capacity();
            self.settle();
        }
    }

    /// Publishes the occupancy as it is now in the root's table (after it shrank; a claim stays at least
    /// what the namespace holds, as every growth was claimed first).
    pub(in crate::store) fn settle(&self) {
        if let Some(s) = &self.share {
            let ix = self.log.index();
            s.settle(ix.occupancy_with(0, 0));
        }
    }

    /// Writable open, steps 6–8: compaction, forgotten keys, the delete reserve, capacity. Returns whether
    /// the journal was compacted and a note when the reserve could not be established.
    pub(in crate::store) fn after_open(&self, forgotten: Vec<String>) -> (bool, Option<String>) {
        // what is on disk now, before anything grows
        self.settle();
        // A journal at its trigger is compacted here, to the end, when that is cheap (its live records fit
        // the floor: at most 1 MiB rewritten) or needed (past its allowance its length would count in the
        // budget and make this open evict for it). Otherwise (a large store closed while a compaction ran)
        // it is compacted in steps after the next calls, as while it ran: a whole compaction at open
        // rewrote every live record before the open returned.
        let (end, trigger, allowance, small) = {
            let ix = self.log.index();
            let small = ix.del_bytes <= ix.compact_floor;
            (
                ix.j_end,
                ix.compact_trigger(),
                ix.journal_allowance(),
                small,
            )
        };
        let compacted = (end > allowance || (end >= trigger && small)) && self.compact().is_ok();
        // A key whose latest record was dropped is deleted for good: if the record became plausible at a
        // later open (the class file grew as new objects took its slot), it would come back. After a
        // compaction these deletes are redundant, and harmless.
        self.append_forgotten(forgotten);
        let _ = self.establish_reserve();
        // Honour a capacity smaller than what is stored (reopened with a lower limit): first the journal's
        // reserve shrinks to what this capacity wants, then objects are evicted; the reserve may only fit
        // once that has made room (a no-op where it is already in place).
        self.shrink_reserve();
        self.evict_to_capacity();
        let note = self.establish_reserve();
        self.settle();
        (compacted, note)
    }

    /// Evicts (and punches) until the occupancy is within the capacity and the root's budget, as far as unpinned objects allow.
    fn evict_to_capacity(&self) {
        for _ in 0..64 {
            let victims = {
                let mut ix = self.log.index();
                let over = ix.occupancy_with(0, 0).saturating_sub(self.limit());
                if over == 0 {
                    return;
                }
                if self.punch_ok.load(Ordering::Relaxed) {
                    let punch = ix.take_punchable(&[]);
                    if !punch.is_empty() {
                        drop(ix);
                        self.punch_slots(&punch);
                        continue;
                    }
                }
                let v = ix.victims(over, &Default::default(), None);
                if !self.punch_ok.load(Ordering::Relaxed) {
                    // freed blocks stay counted where they cannot be punched: evicting frees nothing
                    return;
                }
                v
            };
            if victims.is_empty() {
                return;
            }
            match self.commit_dels(&victims) {
                Ok(g) => self
                    .stats
                    .evictions
                    .fetch_add(g.len() as u64, Ordering::Relaxed),
                Err(_) => return,
            };
        }
    }
}

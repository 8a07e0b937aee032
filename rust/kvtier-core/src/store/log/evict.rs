//! Keeping a namespace to its limits (`space::capacity`): eviction, which commits deletes and punches the
//! freed blocks, before a put and after a writable open (with the open's compaction and delete reserve).

use std::sync::atomic::Ordering;

use crate::store::Shared;

impl Shared {
    /// Before a put: a namespace over its limit (the root's budget lowered, or another namespace waiting
    /// for its fair share) evicts and gives blocks back down to it first.
    pub(in crate::store) fn keep_to_limit(&self) {
        if self.share.is_some() && self.log.index().occupancy_with(0, 0) > self.limit() {
            self.evict_to_capacity();
            self.settle();
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

//! The limits a namespace's occupancy is kept within: its own `capacity_bytes` and, with a budget for the
//! whole store directory, what the other namespaces leave of it (`budget`; docs/STORE.md, "One budget for
//! a store directory"), and the occupancy published to that budget. Keeping to the limits (eviction, which
//! commits deletes) is the log's: `log::evict`.

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

    /// Publishes the occupancy as it is now in the root's table (after it shrank; a claim stays at least
    /// what the namespace holds, as every growth was claimed first).
    pub(in crate::store) fn settle(&self) {
        if let Some(s) = &self.share {
            let ix = self.log.index();
            s.settle(ix.occupancy_with(0, 0));
        }
    }
}

//! A writer's share of the directory's budget: its slot, claims before growth, settles after, and the fair
//! share it keeps to while another namespace waits (docs/STORE.md, "One budget for a store directory").

use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;

use super::{now_ms, Table, WAIT_MS};
use crate::error::Result;

/// A writer's share of the root's budget: its slot in the table.
pub(in crate::store) struct Share {
    table: Table,
    slot: usize,
}

impl Share {
    /// Takes the slot of namespace directory `name` under `root` (creating the table if needed); sets
    /// the budget when `budget` is given (0: none).
    pub(in crate::store) fn open(root: &Path, name: &str, budget: Option<u64>) -> Result<Self> {
        let table = Table::open(root, true)?.expect("created");
        if let Some(b) = budget {
            table.set_budget(b / 4096 * 4096);
        }
        let slot = table.take_slot(root, name)?;
        Ok(Self { table, slot })
    }

    /// The budget, 0 when there is none.
    pub(in crate::store) fn budget(&self) -> u64 {
        self.table.budget()
    }

    /// What the budget leaves this namespace now: the budget less the other namespaces' claims
    /// (`u64::MAX` without a budget) and, while another namespace waits for room, no more than a fair
    /// share: the budget divided among the namespaces whose writers run. A namespace over its share then
    /// evicts down to it, and the one waiting gets the room.
    pub(in crate::store) fn room(&self) -> u64 {
        let b = self.table.budget();
        if b == 0 {
            return u64::MAX;
        }
        let now = now_ms();
        let t = &self.table;
        let (mut others, mut waiting) = (0u64, false);
        for s in (0..t.high()).filter(|&s| s != self.slot) {
            others = others.saturating_add(t.claimed(s).load(SeqCst));
            waiting |= t.waiting(s).load(SeqCst) + WAIT_MS > now;
        }
        let left = b.saturating_sub(others);
        if waiting {
            left.min(b / t.live(self.slot))
        } else {
            left
        }
    }

    /// Claims an occupancy of `total` bytes for this namespace: within its room (`room`), stored first,
    /// then checked against the budget with every other claim read after it. A claim that does not fit is withdrawn (the earlier one
    /// stays) and false. Of two writers claiming at once, at least the later (in the order of their
    /// stores) sees the other's claim: together they never pass the budget. Called with the namespace's
    /// index lock held (one claim at a time per namespace).
    pub(in crate::store) fn claim(&self, total: u64) -> bool {
        let me = self.table.claimed(self.slot);
        let old = me.load(SeqCst);
        let b = self.table.budget();
        if b == 0 {
            me.store(total.max(old), SeqCst);
            return true;
        }
        if total <= self.room() {
            if total > old {
                me.store(total, SeqCst);
            }
            if total.saturating_add(self.table.others(Some(self.slot))) <= b {
                return true;
            }
            if total > old {
                me.store(old, SeqCst);
            }
        }
        // below its fair share: the namespaces over theirs make room (see `room`)
        if old < b / self.table.live(self.slot) {
            self.table.waiting(self.slot).store(now_ms(), SeqCst);
        }
        false
    }

    /// Publishes the namespace's occupancy as it is now (after it shrank, or at open: already on disk).
    /// Index lock held.
    pub(in crate::store) fn settle(&self, total: u64) {
        self.table.claimed(self.slot).store(total, SeqCst);
    }

    /// What this namespace has claimed.
    pub(in crate::store) fn claimed(&self) -> u64 {
        self.table.claimed(self.slot).load(SeqCst)
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        // the writer is gone; its claim stays (its files are still on disk)
        let _ = self
            .table
            .pid(self.slot)
            .compare_exchange(std::process::id(), 0, SeqCst, SeqCst);
    }
}

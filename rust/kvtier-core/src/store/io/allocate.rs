//! `put`, step 4: blocks for the reserved slots that need them (docs/STORE.md, "put").

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::write::Slot;
use crate::store::space::files::ClassFile;
use crate::store::Shared;

impl Shared {
    /// Step 4: blocks for the slots that need them, one `fallocate` per contiguous run. A run that cannot
    /// be allocated is retried once after giving back other classes' free blocks; then its objects fail.
    pub(in crate::store) fn allocate(&self, plan: Vec<Slot>) -> Vec<(Slot, Arc<ClassFile>)> {
        let mut out = Vec::with_capacity(plan.len());
        let mut by_class: HashMap<u32, Vec<Slot>> = HashMap::new();
        for s in plan {
            by_class.entry(s.class).or_default().push(s);
        }
        for (class, mut slots) in by_class {
            let c = match self.class(class) {
                Ok(c) => c,
                Err(_) => {
                    self.drop_slots(&slots);
                    continue;
                }
            };
            slots.sort_by_key(|s| s.slot);
            let mut k = 0;
            while k < slots.len() {
                if !slots[k].grow {
                    out.push((slots[k], c.clone()));
                    k += 1;
                    continue;
                }
                let mut e = k + 1;
                while e < slots.len() && slots[e].grow && slots[e].slot == slots[e - 1].slot + 1 {
                    e += 1;
                }
                let off = u64::from(slots[k].slot) * u64::from(class);
                let len = (e - k) as u64 * u64::from(class);
                let mut r = self.allocate_run(&c, off, len);
                if matches!(&r, Err(err) if err.raw_os_error() == Some(libc::ENOSPC))
                    && self.punch_ok.load(Ordering::Relaxed)
                {
                    let punch = self.log.index().take_punchable(&[]);
                    if !punch.is_empty() {
                        self.punch_slots(&punch);
                        r = self.allocate_run(&c, off, len);
                    }
                }
                match r {
                    Ok(()) => out.extend(slots[k..e].iter().map(|s| (*s, c.clone()))),
                    // the run failed: each slot on its own, so only the objects that cannot get blocks fail
                    Err(_) if e - k > 1 => {
                        for s in &slots[k..e] {
                            let off = u64::from(s.slot) * u64::from(class);
                            match self.allocate_run(&c, off, u64::from(class)) {
                                Ok(()) => out.push((*s, c.clone())),
                                Err(_) => self.drop_slots(std::slice::from_ref(s)),
                            }
                        }
                    }
                    Err(_) => self.drop_slots(&slots[k..e]),
                }
                k = e;
            }
        }
        out
    }

    fn allocate_run(&self, c: &ClassFile, off: u64, len: u64) -> std::io::Result<()> {
        let _g = self.alloc_lock.lock().unwrap_or_else(|p| p.into_inner());
        let before = c.buffered.metadata()?.len();
        c.allocate(off, len, before)
    }

    /// Reserved slots whose objects fail before any write: new ones (that never got blocks) back to the
    /// holes, reused ones (that have blocks) back to the free slots.
    pub(in crate::store) fn drop_slots(&self, slots: &[Slot]) {
        let mut ix = self.log.index();
        for s in slots {
            if s.grow {
                ix.unreserve_unallocated(s.class, s.slot);
            } else {
                ix.unreserve(s.class, s.slot);
            }
            ix.j_pending -= s.journal;
        }
        drop(ix);
        self.fail(slots.len());
    }
}

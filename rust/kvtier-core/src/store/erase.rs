//! Erasing one tenant from a namespace: its objects' bytes overwritten, their records deleted and compacted
//! out of the journal, and its puts refused from then on in this store (docs/SECURITY.md, "Erasure").

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use super::space::files::ClassFile;
use super::Shared;
use crate::error::{Error, Result};
use crate::seal::{tenant_of, valid_tag, TAG_HEX};

/// Stored tags of the tenants erased through this store while it is open, and the gate that orders puts
/// against erasures: a put batch holds it shared from its refusal check to its commit, an erasure takes it
/// exclusively to add its tenant, so every batch either saw the tenant refused or committed before the
/// erasure looks for the tenant's objects.
#[derive(Default)]
pub(super) struct Erased {
    tags: Mutex<HashSet<String>>,
    gate: RwLock<()>,
}

impl Erased {
    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.tags.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pass(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `stag` once no put batch is between its refusal check and its commit.
    fn insert(&self, stag: String) {
        let _closed = self.gate.write().unwrap_or_else(|p| p.into_inner());
        self.set().insert(stag);
    }

    /// Per name, whether it belongs to an erased tenant (None when no tenant is erased).
    pub(super) fn refused(&self, names: &[(&str, usize, u64)]) -> Option<Vec<bool>> {
        let set = self.set();
        if set.is_empty() {
            return None;
        }
        Some(
            names
                .iter()
                .map(|o| tenant_of(o.0).is_some_and(|t| set.contains(t)))
                .collect(),
        )
    }
}

/// Overwrites `[off, off+len)` of `c` with zeros (`what` names the bytes in an error).
fn zero(c: &ClassFile, off: u64, len: u64, what: &str) -> Result<()> {
    let zeros = vec![0u8; usize::try_from(len).unwrap_or(0)];
    c.buffered.write_all_at(&zeros, off).map_err(|e| Error::Os {
        what: format!("overwriting {what} in {}", c.path.display()),
        source: e,
    })
}

fn check_tag(tag: &str) -> Result<()> {
    if valid_tag(tag) {
        Ok(())
    } else {
        Err(Error::arg(
            "tag",
            format!("{tag:?} is not a tenant tag ({TAG_HEX} lowercase hex digits)"),
        ))
    }
}

impl Shared {
    /// Runs `put` on the objects of `objs` whose tenant is not erased here, holding the erasure gate until
    /// it returns; the refused objects fail (never written). Per object of `objs`, whether it was stored.
    pub(super) fn admitted(
        &self,
        objs: &[(&str, usize, u64)],
        put: impl FnOnce(&[(&str, usize, u64)]) -> Result<Vec<bool>>,
    ) -> Result<Vec<bool>> {
        let _pass = self.erased.pass();
        let Some(refused) = self.erased.refused(objs) else {
            return put(objs);
        };
        let kept: Vec<(&str, usize, u64)> = objs
            .iter()
            .zip(&refused)
            .filter(|(_, r)| !**r)
            .map(|(o, _)| *o)
            .collect();
        self.fail(objs.len() - kept.len());
        let mut done = put(&kept)?.into_iter();
        Ok(refused
            .iter()
            .map(|r| !r && done.next().unwrap_or(false))
            .collect())
    }

    /// The tag tenant `tag` has in this store's names (keyed by the keyring when there is one).
    fn stored_tag(&self, tag: &str) -> String {
        match self.opts.keyring.as_deref() {
            Some(ring) => ring.stored_tag(tag),
            None => tag.to_owned(),
        }
    }

    /// Erases tenant `tag` (a `seal::tenant_tag`) from this namespace and returns how many objects it had:
    /// the bytes of each are overwritten with zeros in its data file, every free slot's bytes (objects
    /// deleted or replaced before, the tenant's among them) punched out or zeroed, the data files synced,
    /// the records deleted and the journal compacted afresh, so that neither the data files nor the journal
    /// keep the tenant's KV or its names. From then on this store refuses the tenant's puts (a batch in
    /// flight is waited for and erased with the rest; pages a process still holds are not written back)
    /// until [`Shared::allow_tenant`]. What the file system or the device kept elsewhere (freed journal
    /// blocks, an SSD's remapped cells, a copy-on-write snapshot) is beyond a file's reach: sealing, whose
    /// erasure destroys the key, covers that. A failure returns an error with the work so far kept, and
    /// running the erasure again finishes it.
    pub fn erase_tenant(&self, tag: &str) -> Result<usize> {
        check_tag(tag)?;
        self.writable()?;
        let stag = self.stored_tag(tag);
        self.erased.insert(stag.clone());
        self.refresh_for(None);
        let mine: Vec<(String, u32, u32, u64)> = {
            let ix = self.log.index();
            ix.map
                .iter()
                .filter(|(k, _)| tenant_of(k) == Some(stag.as_str()))
                .map(|(k, e)| (k.to_string(), e.class, e.slot, e.len))
                .collect()
        };
        let mut touched = Vec::new();
        for (name, class, slot, len) in &mine {
            let c = self.class(*class)?;
            let off = u64::from(*slot) * u64::from(*class);
            zero(&c, off, *len, name)?;
            if !touched.iter().any(|t| Arc::ptr_eq(t, &c)) {
                touched.push(c);
            }
        }
        let names: Vec<&str> = mine.iter().map(|m| m.0.as_str()).collect();
        let n = self.delete_stored(&names)?;
        self.scrub_free_slots(&mut touched)?;
        for c in &touched {
            c.buffered.sync_data().map_err(|e| Error::Os {
                what: format!("syncing {}", c.path.display()),
                source: e,
            })?;
        }
        // the first pass finishes a compaction that may have begun before the deletes (its walk copied the
        // tenant's records); the second begins after them, so the journal it writes holds none
        self.compact()?;
        self.compact()?;
        Ok(n)
    }

    /// Punches out (or, where the file system cannot, zeroes) every free slot's blocks, adding the files it
    /// wrote to `touched`. The slots are taken off the free list meanwhile, so no put reuses one mid-way.
    fn scrub_free_slots(&self, touched: &mut Vec<Arc<ClassFile>>) -> Result<()> {
        let slots = self.log.index().take_punchable(&[]);
        let (mut punched, mut zeroed) = (Vec::new(), Vec::new());
        let mut failed = None;
        for &(class, slot) in &slots {
            let r = self.class(class).and_then(|c| {
                let off = u64::from(slot) * u64::from(class);
                if self.punch_ok.load(Ordering::Relaxed) && c.punch(off, u64::from(class)).is_ok() {
                    punched.push((class, slot));
                } else {
                    zero(&c, off, u64::from(class), "a free slot")?;
                    zeroed.push((class, slot));
                }
                if !touched.iter().any(|t| Arc::ptr_eq(t, &c)) {
                    touched.push(c);
                }
                Ok(())
            });
            if let Err(e) = r {
                failed = Some(e);
                break;
            }
        }
        let rest: Vec<(u32, u32)> = slots
            .iter()
            .filter(|s| !punched.contains(s) && !zeroed.contains(s))
            .copied()
            .collect();
        {
            let mut ix = self.log.index();
            ix.punched(&punched, true);
            ix.punched(&zeroed, false);
            ix.punched(&rest, false);
        }
        self.stats
            .punched_slots
            .fetch_add(punched.len() as u64, Ordering::Relaxed);
        failed.map_or(Ok(()), Err)
    }

    /// Lets tenant `tag`, erased through this store, put objects again; whether it was erased here.
    pub fn allow_tenant(&self, tag: &str) -> Result<bool> {
        check_tag(tag)?;
        Ok(self.erased.set().remove(&self.stored_tag(tag)))
    }
}

//! Erasing one tenant from a namespace: its objects' bytes overwritten, their records deleted and compacted
//! out of the journal, and its puts refused from then on in this store (docs/SECURITY.md, "Erasure").

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use super::Shared;
use crate::error::{Error, Result};
use crate::seal::{tenant_of, valid_tag, TAG_HEX};

/// Stored tags of the tenants erased through this store while it is open.
#[derive(Default)]
pub(super) struct Erased(Mutex<HashSet<String>>);

impl Erased {
    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
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
    /// The tag tenant `tag` has in this store's names (keyed by the keyring when there is one).
    fn stored_tag(&self, tag: &str) -> String {
        match self.opts.keyring.as_deref() {
            Some(ring) => ring.stored_tag(tag),
            None => tag.to_owned(),
        }
    }

    /// Erases tenant `tag` (a `seal::tenant_tag`) from this namespace and returns how many objects it had:
    /// the bytes of each are overwritten with zeros in its data file (and synced), their records deleted,
    /// and the journal compacted, so that neither the data files nor the journal keep the tenant's KV or
    /// its names. From then on this store refuses the tenant's puts (pages a process still holds are not
    /// written back) until [`Shared::allow_tenant`]. What the file system or the device kept elsewhere
    /// (freed journal blocks, an SSD's remapped cells, a copy-on-write snapshot) is beyond a file's reach:
    /// sealing, whose erasure destroys the key, covers that.
    pub fn erase_tenant(&self, tag: &str) -> Result<usize> {
        check_tag(tag)?;
        self.writable()?;
        let stag = self.stored_tag(tag);
        self.erased.set().insert(stag.clone());
        self.refresh_for(None);
        let mine: Vec<(String, u32, u32, u64)> = {
            let ix = self.lock_index();
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
            let zeros = vec![0u8; usize::try_from(*len).unwrap_or(0)];
            c.buffered
                .write_all_at(&zeros, off)
                .map_err(|e| Error::Os {
                    what: format!("overwriting erased object {name} in {}", c.path.display()),
                    source: e,
                })?;
            if !touched
                .iter()
                .any(|t: &std::sync::Arc<_>| std::sync::Arc::ptr_eq(t, &c))
            {
                touched.push(c);
            }
        }
        for c in &touched {
            c.buffered.sync_data().map_err(|e| Error::Os {
                what: format!("syncing {}", c.path.display()),
                source: e,
            })?;
        }
        let names: Vec<&str> = mine.iter().map(|m| m.0.as_str()).collect();
        let n = self.delete_stored(&names)?;
        if n > 0 {
            self.compact()?;
        }
        Ok(n)
    }

    /// Lets tenant `tag`, erased through this store, put objects again; whether it was erased here.
    pub fn allow_tenant(&self, tag: &str) -> Result<bool> {
        check_tag(tag)?;
        Ok(self.erased.set().remove(&self.stored_tag(tag)))
    }
}

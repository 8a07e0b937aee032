//! The store's side of sealing (`crate::seal`): the tenant keys of one batch, and the aligned buffers that
//! sealed and coded objects are written from and read into (so they keep O_DIRECT).

use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::seal::{tenant_of, Keyring, Seal, SealKey};
use crate::store::{Shared, ALIGN};

/// Heap bytes aligned to the store's block size, zeroed when allocated, freed on drop; `len` of them in use.
pub(in crate::store) struct Aligned {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: `Aligned` owns its allocation exclusively (like a `Box<[u8]>`); no aliasing pointer escapes.
unsafe impl Send for Aligned {}

impl Aligned {
    /// Room for `cap` bytes (rounded up to whole blocks), all zero; None without memory.
    fn with_capacity(cap: usize) -> Option<Self> {
        let size = cap.div_ceil(ALIGN as usize).max(1) * ALIGN as usize;
        let layout = Layout::from_size_align(size, ALIGN as usize).ok()?;
        // SAFETY: `layout` has a non-zero size; the allocation is zeroed, so every byte of it is initialized.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(Self {
            ptr,
            len: 0,
            layout,
        })
    }

    fn capacity(&self) -> usize {
        self.layout.size()
    }

    /// Makes the buffer a copy of `src` (which must fit its capacity).
    fn fill_from(&mut self, src: &[u8]) {
        assert!(src.len() <= self.capacity());
        // SAFETY: `src.len()` bytes fit the allocation (checked), which `src` (a live slice, not ours) cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr(), src.len()) };
        self.len = src.len();
    }

    pub(in crate::store) fn as_slice(&self) -> &[u8] {
        // `len` <= the capacity: `fill_from` and `ScratchPool::take` check it.
        // SAFETY: every byte of the live allocation is initialized (zeroed at allocation), `len` within it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(in crate::store) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `with_capacity` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Most bytes of idle buffers a store keeps for sealing (the rest are freed when given back).
const KEEP_BYTES: usize = 256 << 20;

/// Idle aligned buffers, reused by sealed writes (a fresh allocation per object costs its page faults).
#[derive(Default)]
pub(in crate::store) struct ScratchPool {
    free: Mutex<Vec<Aligned>>,
}

impl ScratchPool {
    /// A buffer holding a copy of `src`; None without memory.
    pub(in crate::store) fn copy_of(&self, src: &[u8]) -> Option<Aligned> {
        let mut b = self.take(src.len())?;
        b.fill_from(src);
        Some(b)
    }

    /// A buffer of `len` bytes in use (what they hold is unspecified: zeros or an earlier use's bytes);
    /// None without memory.
    pub(in crate::store) fn take(&self, len: usize) -> Option<Aligned> {
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let i = free.iter().position(|b| b.capacity() >= len);
            i.map(|i| free.swap_remove(i))
        };
        let mut b = match reused {
            Some(b) => b,
            None => Aligned::with_capacity(len)?,
        };
        assert!(len <= b.capacity());
        b.len = len;
        Some(b)
    }

    /// Takes a buffer back (kept while the idle ones stay under `KEEP_BYTES`).
    pub(in crate::store) fn give(&self, b: Aligned) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.iter().map(Aligned::capacity).sum::<usize>() + b.capacity() <= KEEP_BYTES {
            free.push(b);
        }
    }
}

/// `objs` under the names `names` (one per object, in order).
pub(in crate::store) fn renamed<'a>(
    objs: &[(&str, usize, u64)],
    names: &'a [String],
) -> Vec<(&'a str, usize, u64)> {
    objs.iter()
        .zip(names)
        .map(|(o, n)| (n.as_str(), o.1, o.2))
        .collect()
}

impl Shared {
    /// With a keyring, the name each of `names` is stored under ([`Keyring::stored_name`]): the journal, the
    /// index and the data files then hold no engine key and no tenant tag. In clear, `None` (the names as
    /// given). Each name is checked first as a key of this store (`journal`: one about to be written there).
    pub(in crate::store) fn stored_names<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
        journal: bool,
    ) -> Result<Option<Vec<String>>> {
        let Some(ring) = self.opts.keyring.as_deref() else {
            return Ok(None);
        };
        names
            .map(|n| {
                if journal {
                    Self::check_journal_key(n)?;
                } else {
                    Self::check_key(n)?;
                }
                Ok(ring.stored_name(n))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

/// The sealing keys of the tenants one batch touches, resolved once per batch (one look at each tenant's
/// key file, so an erased tenant's key stops working at the next batch).
pub(in crate::store) struct SealKeys {
    keys: HashMap<Option<String>, Option<Arc<SealKey>>>,
    /// The namespace: with the object's name, what each seal authenticates (an object copied into another
    /// namespace of the same keyring fails).
    namespace: String,
}

/// What opening a sealed object found.
pub(in crate::store) enum Opened {
    /// Verified and decrypted.
    Ok,
    /// The tenant has no key here now (erased, or its key file not readable): a miss, the object kept.
    NoKey,
    /// Sealed under a key of the tenant that has since been destroyed and replaced: it can never open.
    Stale,
    /// The tag did not verify: the object is not what was sealed under this name and key.
    Failed,
}

impl SealKeys {
    /// None for a store in clear. `create`: writes create a tenant's key at its first object.
    pub(in crate::store) fn for_batch<'a>(
        ring: Option<&Keyring>,
        namespace: &str,
        names: impl Iterator<Item = &'a str>,
        create: bool,
    ) -> Option<Self> {
        let ring = ring?;
        let tags: Vec<Option<&str>> = names.map(tenant_of).collect();
        Some(Self {
            keys: ring.keys_for(&tags, create),
            namespace: namespace.to_owned(),
        })
    }

    fn aad(&self, name: &str) -> String {
        format!("{}\0{name}", self.namespace)
    }

    fn key(&self, name: &str) -> Option<&SealKey> {
        self.keys
            .get(&tenant_of(name).map(str::to_owned))?
            .as_deref()
    }

    /// An aligned sealed copy of `plain` under object name `name` (from `pool`: give it back after the
    /// write), and its seal; None if the tenant has no key, memory ran out or the random source failed.
    pub(in crate::store) fn seal(
        &self,
        pool: &ScratchPool,
        name: &str,
        plain: &[u8],
    ) -> Option<(Aligned, Seal)> {
        let key = self.key(name)?;
        let mut buf = pool.copy_of(plain)?;
        match key.seal(&self.aad(name), buf.as_mut_slice()) {
            Ok(seal) => Some((buf, seal)),
            Err(_) => {
                pool.give(buf);
                None
            }
        }
    }

    /// Opens `buf` (object `name`) in place.
    pub(in crate::store) fn open(&self, name: &str, buf: &mut [u8], seal: &Seal) -> Opened {
        match self.key(name) {
            None => Opened::NoKey,
            Some(k) if !k.made(seal) => Opened::Stale,
            Some(k) if k.open(&self.aad(name), buf, seal) => Opened::Ok,
            Some(_) => Opened::Failed,
        }
    }

    /// Whether an object of name `name` with `seal` was sealed under the tenant's current key (false for a
    /// clear object, a tenant without a key, or a key since replaced).
    pub(in crate::store) fn current(&self, name: &str, seal: Option<&Seal>) -> bool {
        match (self.key(name), seal) {
            (Some(k), Some(s)) => k.made(s),
            _ => false,
        }
    }
}

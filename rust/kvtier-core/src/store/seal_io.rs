//! The store's side of sealing (`crate::seal`): the tenant keys of one batch, and the aligned copies that
//! sealed objects are written from (so they keep O_DIRECT).

use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

use super::ALIGN;
use crate::seal::{tenant_of, Keyring, Seal, SealKey};

/// Heap bytes aligned to the store's block size, freed on drop.
pub(super) struct Aligned {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: `Aligned` owns its allocation exclusively (like a `Box<[u8]>`); no aliasing pointer escapes.
unsafe impl Send for Aligned {}

impl Aligned {
    /// `len` bytes (rounded up to whole blocks in the allocation, zeroed), or None without memory.
    fn zeroed(len: usize) -> Option<Self> {
        let size = len.div_ceil(ALIGN as usize).max(1) * ALIGN as usize;
        let layout = Layout::from_size_align(size, ALIGN as usize).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(Self { ptr, len, layout })
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `layout.size() >= len` initialised (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The sealing keys of the tenants one batch touches, resolved once per batch (one look at each tenant's
/// key file, so an erased tenant's key stops working at the next batch).
pub(super) struct SealKeys {
    keys: HashMap<Option<String>, Option<Arc<SealKey>>>,
}

impl SealKeys {
    /// None for a store in clear. `create`: writes create a tenant's key at its first object.
    pub(super) fn for_batch<'a>(
        ring: Option<&Keyring>,
        names: impl Iterator<Item = &'a str>,
        create: bool,
    ) -> Option<Self> {
        let ring = ring?;
        let tags: Vec<Option<&str>> = names.map(tenant_of).collect();
        Some(Self {
            keys: ring.keys_for(&tags, create),
        })
    }

    fn key(&self, name: &str) -> Option<&SealKey> {
        self.keys
            .get(&tenant_of(name).map(str::to_owned))?
            .as_deref()
    }

    /// An aligned sealed copy of `plain` under object name `name`, and its seal; None if the tenant has no
    /// key, memory ran out or the random source failed.
    pub(super) fn seal(&self, name: &str, plain: &[u8]) -> Option<(Aligned, Seal)> {
        let key = self.key(name)?;
        let mut buf = Aligned::zeroed(plain.len())?;
        buf.as_mut_slice().copy_from_slice(plain);
        let seal = key.seal(name, buf.as_mut_slice()).ok()?;
        Some((buf, seal))
    }

    /// Opens `buf` (object `name`) in place; false if the tenant has no key or the tag does not verify.
    pub(super) fn open(&self, name: &str, buf: &mut [u8], seal: &Seal) -> bool {
        self.key(name).is_some_and(|k| k.open(name, buf, seal))
    }
}

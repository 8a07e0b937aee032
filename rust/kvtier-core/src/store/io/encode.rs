//! Coding a put batch's objects (docs/STORE.md, "Compressed objects"): each object that the store's codec
//! shrinks by at least one block is written as its coded copy, the others as given.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use super::seal_io::{Aligned, SealKeys};
use crate::store::{Shared, ALIGN};

/// The objects of a put batch as stored ([`Shared::encode_batch`]).
pub(in crate::store) struct Encoded<'a> {
    /// `(key, ptr, len)` of what is written: the coded copy, or the object as given.
    pub(in crate::store) objs: Vec<(&'a str, usize, u64)>,
    /// The length each coded object decodes to; `None`: stored as given.
    pub(in crate::store) coded: Vec<Option<u64>>,
    /// The coded copies (`objs` points into them).
    pub(in crate::store) bufs: Vec<Option<Aligned>>,
}

/// Objects up to this size keep their thread's encode buffer between batches.
const MAX_KEPT_ENCODE: usize = 16 << 20;

/// Idle encode buffers, shared by every store of the process: a batch's IO threads are new threads, so
/// buffers of their own would be allocated (and page-faulted) again by every batch.
static ENCODE_BUFS: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
/// Most idle encode buffers kept.
const MAX_IDLE_ENCODE: usize = 16;

impl Shared {
    /// The objects as the batch stores them: with a codec, each object that shrinks by at least one block
    /// replaced by its coded copy (`coded[i]`: the length it decodes to), the others as given. Objects
    /// already stored (as the put will find them: `keys`' current key in a sealed store) are not coded (they
    /// are acknowledged without IO), nor is anything when no memory is left for a copy (stored as given).
    pub(in crate::store) fn encode_batch<'a>(
        &self,
        objs: &[(&'a str, usize, u64)],
        keys: Option<&SealKeys>,
    ) -> Encoded<'a> {
        let n = objs.len();
        let mut enc = Encoded {
            objs: objs.to_vec(),
            coded: vec![None; n],
            bufs: (0..n).map(|_| None).collect(),
        };
        let Some(elem) = self.opts.codec else {
            return enc;
        };
        // (stored as the put would find it: in a sealed store, under its tenant's current key)
        let stored: Vec<bool> = {
            let ix = self.log.index();
            objs.iter()
                .map(|(k, _, _)| {
                    ix.get(k).is_some_and(|e| match keys {
                        Some(keys) => keys.current(k, e.seal.as_deref()),
                        None => e.seal.is_none(),
                    })
                })
                .collect()
        };
        let t0 = std::time::Instant::now();
        let out: Vec<Mutex<Option<Aligned>>> = (0..n).map(|_| Mutex::new(None)).collect();
        self.parallel(n, |i| {
            let (_, ptr, len) = objs[i];
            if stored[i] {
                return;
            }
            // SAFETY: the caller guarantees [ptr, ptr+len) is readable for the whole call.
            let raw = unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) };
            let mut v = ENCODE_BUFS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop()
                .unwrap_or_default();
            v.clear();
            let coded = crate::codec::encode_shrinking(raw, elem, &mut v);
            if coded.is_some_and(|n| (n as u64).div_ceil(ALIGN) < len.div_ceil(ALIGN)) {
                *out[i].lock().unwrap_or_else(|p| p.into_inner()) = self.scratch.copy_of(&v);
            }
            // (one huge object does not keep its buffer for the process's life)
            if v.capacity() <= 2 * crate::codec::max_encoded_len(MAX_KEPT_ENCODE) {
                let mut idle = ENCODE_BUFS.lock().unwrap_or_else(|p| p.into_inner());
                if idle.len() < MAX_IDLE_ENCODE {
                    idle.push(v);
                }
            }
        });
        let (mut raw_bytes, mut coded_bytes) = (0u64, 0u64);
        for (i, slot) in out.into_iter().enumerate() {
            let Some(b) = slot.into_inner().unwrap_or_else(|p| p.into_inner()) else {
                continue;
            };
            raw_bytes += objs[i].2;
            coded_bytes += b.as_slice().len() as u64;
            enc.objs[i] = (
                objs[i].0,
                b.as_slice().as_ptr() as usize,
                b.as_slice().len() as u64,
            );
            enc.coded[i] = Some(objs[i].2);
            enc.bufs[i] = Some(b);
        }
        let st = &self.stats;
        st.encode_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        st.encoded_raw_bytes.fetch_add(raw_bytes, Ordering::Relaxed);
        st.encoded_bytes.fetch_add(coded_bytes, Ordering::Relaxed);
        st.encode_input_bytes.fetch_add(
            objs.iter()
                .zip(&stored)
                .filter(|(_, &s)| !s)
                .map(|(o, _)| o.2)
                .sum(),
            Ordering::Relaxed,
        );
        enc
    }
}

//! `put`: reserve slots (making room by punching free blocks and evicting), allocate exactly the blocks
//! needed, write and sync the objects, commit their records (docs/STORE.md, "put").

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::pages::{stored_pages, torn_pages};
use super::seal_io::renamed;
use super::seal_io::{Aligned, SealKeys};
use crate::error::{Error, Result};
use crate::fault;
use crate::seal::Seal;
use crate::store::index::put_journal_cost;
use crate::store::journal::{Placement, PutParts};
use crate::store::log::commit::PutItem;
use crate::store::space::files::ClassFile;
use crate::store::stats::phase;
use crate::store::{Shared, ALIGN, MAX_OBJECT};

/// Reservation rounds before the objects still without a slot fail (each round assigns, punches or
/// evicts something, so this is far above what progress needs).
const MAX_ROUNDS: usize = 256;

/// A planned object: index into the batch, size class, slot, whether its blocks must be allocated, and
/// the journal bytes it has pending.
#[derive(Clone, Copy)]
pub(in crate::store) struct Slot {
    pub(in crate::store) i: usize,
    pub(in crate::store) class: u32,
    pub(in crate::store) slot: u32,
    pub(in crate::store) grow: bool,
    pub(in crate::store) journal: u64,
}

impl Shared {
    /// Stores objects `(key, ptr, len)`; returns per object whether it is now durably stored. An object
    /// whose key already exists is left as is (keys name content) and reported stored. IO errors fail the
    /// objects they touch and are never raised; only invalid arguments are.
    ///
    /// # Safety
    /// Each `[ptr, ptr+len)` must be readable memory that stays alive and unmodified during the call.
    pub unsafe fn put(&self, objs: &[(&str, usize, u64)]) -> Result<Vec<bool>> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.put_whole(objs, 1) }
    }

    /// [`Shared::put`] of pages of `per` consecutive objects each, every page written whole (see `reserve`).
    ///
    /// # Safety
    /// As [`Shared::put`].
    pub(in crate::store) unsafe fn put_whole(
        &self,
        objs: &[(&str, usize, u64)],
        per: usize,
    ) -> Result<Vec<bool>> {
        let stored = self.stored_names(objs.iter().map(|o| o.0), true)?;
        let renamed = stored.as_deref().map(|n| renamed(objs, n));
        let objs = renamed.as_deref().unwrap_or(objs);
        // Renaming keeps every range, and the admitted objects are a subset of the caller's ranges (an erased
        // tenant's refused objects are whole pages: a page's objects carry one tenant).
        // SAFETY: the caller's guarantee, passed on (see above).
        self.admitted(objs, |kept| unsafe { self.put_stored(kept, per) })
    }

    /// [`Shared::put`] of objects named as the store keeps them.
    ///
    /// # Safety
    /// As [`Shared::put`].
    unsafe fn put_stored(&self, objs: &[(&str, usize, u64)], per: usize) -> Result<Vec<bool>> {
        let t0 = std::time::Instant::now();
        let mut t = t0;
        for (k, _, len) in objs {
            Self::check_journal_key(k)?;
            if *len == 0 || *len > MAX_OBJECT {
                return Err(Error::arg(
                    "sizes",
                    format!("object {k:?}: length must be in 1..={MAX_OBJECT}, got {len}"),
                ));
            }
        }
        let mut ok = vec![false; objs.len()];
        if self.read_only || self.poisoned.load(Ordering::Relaxed) {
            self.fail(objs.len());
            return Ok(ok);
        }
        self.stats.lap(phase::VALIDATE, &mut t);
        // the tenants' keys, once per batch: an object already stored under a key since replaced is written again
        let keys = SealKeys::for_batch(
            self.opts.keyring.as_deref(),
            &self.namespace,
            objs.iter().map(|o| o.0),
            true,
        );
        // with a codec: each object that shrinks by a block or more is stored coded (docs/STORE.md,
        // "Compressed objects"); the coded copies live until the batch ends
        let enc = self.encode_batch(objs, keys.as_ref());
        let objs = &enc.objs[..];
        self.stats.lap(phase::ENCODE, &mut t);
        self.keep_to_limit();
        self.stats.lap(phase::KEEP, &mut t);
        let mut dups = Vec::new();
        let plan = self.reserve(objs, per, &enc.coded, keys.as_ref(), &mut ok, &mut dups);
        self.stats.lap(phase::RESERVE, &mut t);
        // A running compaction's step goes to the background thread now, to overlap this batch's IO
        // (docs/STORE.md, "put", step 8); the batch never waits for it (joined at the batch's end, it made
        // batches wait 221-344 ms at load: the walk's CPU).
        self.step_in_background();
        self.put_rest(objs, per, &enc.coded, keys.as_ref(), plan, &mut ok, &mut t);
        for (d, f) in dups {
            ok[d] = ok[f];
        }
        for b in enc.bufs.into_iter().flatten() {
            self.scratch.give(b);
        }
        let mut t = std::time::Instant::now();
        // a compaction this batch's records made due starts there too
        self.step_in_background();
        self.stats.lap(phase::COMPACT, &mut t);
        self.settle();
        self.stats.lap(phase::SETTLE, &mut t);
        let stored = ok.iter().filter(|&&b| b).count() as u64;
        self.stats.puts.fetch_add(stored, Ordering::Relaxed);
        self.stats
            .put_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.persist_stats(false);
        self.stats.lap(phase::STATS_FILE, &mut t);
        Ok(ok)
    }

    /// Steps 4-6: blocks, the objects' bytes, their records; `ok` set for the objects committed.
    #[allow(clippy::too_many_arguments)]
    fn put_rest(
        &self,
        objs: &[(&str, usize, u64)],
        per: usize,
        coded: &[Option<u64>],
        keys: Option<&SealKeys>,
        plan: Vec<Slot>,
        ok: &mut [bool],
        t: &mut std::time::Instant,
    ) {
        let plan = self.allocate(plan);
        self.stats.lap(phase::ALLOCATE, t);
        let mut done = self.write_all(objs, keys, plan);
        // a page is committed whole or not at all: the objects written of a page whose other object (one that
        // was to replace a stored half) failed or found no room are given back, never paired with that half
        let torn = torn_pages(done.iter().map(|d| d.0.i), ok, per);
        if !torn.is_empty() {
            let (gone, kept): (Vec<_>, Vec<_>) =
                done.into_iter().partition(|d| torn.contains(&d.0.i));
            let mut ix = self.log.index();
            for (s, _, _) in &gone {
                ix.unreserve(s.class, s.slot); // written and synced, never committed: a free slot again
                ix.j_pending -= s.journal;
            }
            drop(ix);
            self.fail(gone.len());
            done = kept;
        }
        done.sort_unstable_by_key(|(s, _, _)| s.i); // records and LRU order follow the batch's order
        let pending: u64 = done.iter().map(|(s, _, _)| s.journal).sum();
        let items: Vec<PutItem> = done
            .iter()
            .map(|(s, crc, seal)| {
                let at = Placement::new(s.class, s.slot, objs[s.i].2, *crc)
                    .with_seal(*seal)
                    .with_coded(coded[s.i]);
                // the record is no longer than what `reserve` counted for it
                debug_assert!(put_journal_cost(objs[s.i].0.len(), PutParts::of(&at)) <= s.journal);
                (objs[s.i].0.to_owned(), at)
            })
            .collect();
        let committed = self.commit_puts(&items).is_ok();
        {
            let mut ix = self.log.index();
            ix.j_pending -= pending;
            if !committed {
                for (s, _, _) in &done {
                    ix.unreserve(s.class, s.slot);
                }
            }
        }
        let (mut bytes, mut raw) = (0, 0);
        if committed {
            for (s, _, _) in &done {
                ok[s.i] = true;
                bytes += objs[s.i].2;
                raw += coded[s.i].unwrap_or(objs[s.i].2);
            }
        } else {
            self.fail(done.len());
        }
        self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        self.stats
            .raw_bytes_written
            .fetch_add(raw, Ordering::Relaxed);
    }

    pub(in crate::store) fn fail(&self, n: usize) {
        self.stats
            .write_failures
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Step 2–3: a slot for every object that is not already stored, making room as needed. Objects that
    /// cannot get one are counted as failures (their `ok` stays false). A page of `per` objects holding
    /// only some of them is written whole ([`stored_pages`]: KV of the same tokens can differ between runs).
    fn reserve(
        &self,
        objs: &[(&str, usize, u64)],
        per: usize,
        coded: &[Option<u64>],
        keys: Option<&SealKeys>,
        ok: &mut [bool],
        dups: &mut Vec<(usize, usize)>,
    ) -> Vec<Slot> {
        let mut want: Vec<(usize, u32, u64)> = Vec::new(); // (index, class, journal bytes)

        // the optional parts of the put records the batch commits (`put_rest` makes their `Placement`s)
        let sealed = PutParts::NONE.with(PutParts::SEALED, keys.is_some());
        {
            let mut ix = self.log.index();
            let have = stored_pages(&ix, objs, per, keys);
            let mut first: HashMap<&str, usize> = HashMap::new();
            for (i, (k, _, len)) in objs.iter().enumerate() {
                if let Some(&f) = first.get(k) {
                    // a key twice in one batch: the copy shares the first one's fate (acknowledging it at
                    // once would report a page stored whose only write then failed)
                    dups.push((i, f));
                    continue;
                }
                first.insert(k, i);
                if have[i] {
                    ix.touch(k);
                    ok[i] = true;
                    continue;
                }
                let class = len.div_ceil(ALIGN) * ALIGN;
                if class > self.opts.capacity_bytes {
                    continue; // can never fit: fails below
                }
                // MAX_OBJECT keeps every class within u32 (checked by the caller)
                let class = u32::try_from(class).expect("class <= MAX_OBJECT fits u32");
                let parts = sealed.with(PutParts::CODED, coded[i].is_some());
                want.push((i, class, put_journal_cost(k.len(), parts)));
            }
        }
        let mut plan = Vec::new();
        let batch_keys: std::collections::HashSet<&str> = objs.iter().map(|o| o.0).collect();
        let mut compacted = false;
        for _ in 0..MAX_ROUNDS {
            let victims = {
                let mut ix = self.log.index();
                let mut left = Vec::new();
                for &(i, class, journal) in &want {
                    let grow = ix.free.get(&class).is_none_or(|v| v.is_empty());
                    let add = if grow { u64::from(class) } else { 0 };
                    if !left.is_empty() || !self.fits(&ix, ix.occupancy_with(add, journal)) {
                        left.push((i, class, journal));
                        continue;
                    }
                    let slot = match ix.reuse_slot(class) {
                        Some(s) => s,
                        None => ix.grow_slot(class),
                    };
                    ix.j_pending += journal;
                    plan.push(Slot {
                        i,
                        class,
                        slot,
                        grow,
                        journal,
                    });
                }
                want = left;
                let Some(&(_, class, _)) = want.first() else {
                    break;
                };
                let punching = self.punch_ok.load(Ordering::Relaxed);
                if ix.free.get(&class).is_some_and(|v| !v.is_empty()) {
                    // Only the journal is short of room (the object could reuse a free slot): evicting
                    // frees nothing for it (a del consumes what was prepaid). The budget holds room for
                    // the journal's garbage up to past the compaction trigger, so this happens only when a
                    // compaction failed or fell behind: finish one now if the journal holds dead records;
                    // else give free slots' blocks back (objects then take new blocks, which eviction
                    // provides).
                    if !compacted && ix.j_end > ix.journal_allowance() && ix.j_end > ix.del_bytes {
                        drop(ix);
                        compacted = true;
                        let _ = self.compact();
                        continue;
                    }
                    let punch = if punching {
                        ix.take_punchable(&[])
                    } else {
                        Vec::new()
                    };
                    if punch.is_empty() {
                        break;
                    }
                    drop(ix);
                    let mut tp = std::time::Instant::now();
                    self.punch_slots(&punch);
                    self.stats.lap(phase::PUNCH, &mut tp);
                    continue;
                }
                // room for every object still waiting at once (not one per round)
                let (grow, journal) = want
                    .iter()
                    .fold((0u64, 0u64), |(g, j), w| (g + u64::from(w.1), j + w.2));
                let deficit = ix
                    .occupancy_with(grow, journal)
                    .saturating_sub(self.limit());
                if punching {
                    let keep: Vec<(u32, usize)> = want.iter().map(|w| (w.1, 1)).collect();
                    let punch = ix.take_punchable(&keep);
                    if !punch.is_empty() {
                        drop(ix);
                        let mut tp = std::time::Instant::now();
                        self.punch_slots(&punch);
                        self.stats.lap(phase::PUNCH, &mut tp);
                        continue;
                    }
                }
                // without hole punching only a slot of the wanted class makes room
                let mut tv = std::time::Instant::now();
                let victims = ix.victims(deficit, &batch_keys, (!punching).then_some(class));
                self.stats.lap(phase::VICTIMS, &mut tv);
                if victims.is_empty() {
                    break;
                }
                victims
            };
            let mut te = std::time::Instant::now();
            let r = self.commit_dels(&victims);
            self.stats.lap(phase::EVICT, &mut te);
            match r {
                Ok(gone) => {
                    self.stats
                        .evictions
                        .fetch_add(gone.len() as u64, Ordering::Relaxed);
                }
                Err(_) => break, // nothing was evicted; the objects still waiting fail
            }
        }
        self.fail(want.len());
        plan
    }

    /// Step 5: write every object in parallel (sealing it first in a sealed store), then sync each class
    /// file. Returns the objects written and synced with their checksums and seals; the others' slots are
    /// released and their objects failed.
    fn write_all(
        &self,
        objs: &[(&str, usize, u64)],
        keys: Option<&SealKeys>,
        plan: Vec<(Slot, Arc<ClassFile>)>,
    ) -> Vec<(Slot, u32, Option<Seal>)> {
        let mut t = std::time::Instant::now();
        let crcs: Vec<AtomicU64> = (0..plan.len()).map(|_| AtomicU64::new(u64::MAX)).collect();
        let seals: Vec<OnceLock<Seal>> = (0..plan.len()).map(|_| OnceLock::new()).collect();
        self.parallel(plan.len(), |j| {
            let (s, ref c) = plan[j];
            let (key, ptr, len) = objs[s.i];
            // SAFETY: the caller guarantees [ptr, ptr+len) is readable for the whole call.
            let plain = unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) };
            let mut sealed_copy: Option<Aligned> = None;
            let bytes = match keys {
                None => plain,
                Some(keys) => {
                    let Some((buf, seal)) = keys.seal(&self.scratch, key, plain) else {
                        return; // no key or no memory: the object fails
                    };
                    let _ = seals[j].set(seal);
                    sealed_copy.insert(buf).as_slice()
                }
            };
            let crc = crate::hash::object_crc(bytes, key);
            let off = u64::from(s.slot) * u64::from(s.class);
            let res = match fault::take("data_write") {
                // partial writes exist only here; everything else is handled as at any other point
                Some(fault::Fault::Short(e)) => std::os::unix::fs::FileExt::write_all_at(
                    &c.buffered,
                    &bytes[..bytes.len() / 2],
                    off,
                )
                .and(Err(std::io::Error::from_raw_os_error(e))),
                Some(fault::Fault::Torn) => {
                    let mut torn = bytes.to_vec();
                    torn[bytes.len() / 2..].fill(0);
                    c.write(&torn, off)
                }
                other => fault::apply(other).and_then(|()| c.write_object(bytes, off)),
            };
            if res.is_ok() {
                crcs[j].store(u64::from(crc), Ordering::Relaxed);
            }
            if let Some(b) = sealed_copy {
                self.scratch.give(b);
            }
        });
        self.stats.lap(phase::WRITE, &mut t);
        let mut synced: HashMap<u32, bool> = HashMap::new();
        for (s, c) in &plan {
            synced.entry(s.class).or_insert_with(|| {
                fault::check("data_sync")
                    .and_then(|()| c.buffered.sync_data())
                    .is_ok()
            });
        }
        self.stats.lap(phase::DATA_SYNC, &mut t);
        let mut good = Vec::new();
        let mut bad = 0;
        let mut ix = self.log.index();
        for (j, (s, _)) in plan.iter().enumerate() {
            let crc = crcs[j].load(Ordering::Relaxed);
            if crc == u64::MAX || !synced[&s.class] {
                ix.unreserve(s.class, s.slot);
                ix.j_pending -= s.journal;
                bad += 1;
            } else {
                good.push((*s, crc as u32, seals[j].get().copied()));
            }
        }
        drop(ix);
        self.fail(bad);
        good
    }
}

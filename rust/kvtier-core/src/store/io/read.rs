//! `get`, lookups and `verify` (docs/STORE.md, "get").

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Mutex;

use super::read_coded::{CodedRead, CORRUPT, IO_ERROR, NO_KEY, OK, STALE};
use super::seal_io::renamed;
use super::seal_io::{Opened, SealKeys};
use crate::error::Result;
use crate::fault;
use crate::store::index::Entry;
use crate::store::Shared;

/// What [`PageStore::verify`] found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    /// Objects read and checked.
    pub checked: usize,
    /// Keys whose bytes failed their checksum.
    pub corrupt: Vec<String>,
    /// Keys that could not be read (IO error, or the data file is shorter than the object).
    pub unreadable: Vec<String>,
}

impl Shared {
    /// Reads objects `(key, ptr, len)` into memory; returns per object whether it was found with exactly
    /// that length and its checksum verified. A corrupt object is a counted miss and is dropped (del record
    /// first; if that cannot be logged it is marked bad: never served, never overwritten).
    ///
    /// # Safety
    /// Each `[ptr, ptr+len)` must be writable memory, not read or written by anyone else during the call.
    pub unsafe fn get(&self, objs: &[(&str, usize, u64)]) -> Result<Vec<bool>> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.get_in_two(objs, &[], &mut || {}) }
    }

    /// As [`Shared::get`], in two passes: the first `prefix[i]` bytes of every object (read, not yet
    /// checked), then `between()`, then the rest of each object and the check of the whole (the bytes of
    /// the first pass are never written again). An object whose first pass failed is a failed read, even if
    /// the rest would read: what the first pass left may have been used meanwhile. The objects stay pinned
    /// from the look-up to the end. Without `prefix` (empty), or in a sealed store (whose bytes are usable
    /// only once opened), one pass, and `between()` after it. `between` is called exactly once.
    ///
    /// # Safety
    /// As [`Shared::get`], except that from `between()` on others may read (never write) the first
    /// `prefix[i]` bytes of object i: the second pass only reads them too (to sum them).
    pub unsafe fn get_in_two(
        &self,
        objs: &[(&str, usize, u64)],
        prefix: &[u64],
        between: &mut dyn FnMut(),
    ) -> Result<Vec<bool>> {
        let mut between = Some(between);
        let mut call_between = || {
            if let Some(f) = between.take() {
                f();
            }
        };
        if !prefix.is_empty() && prefix.len() != objs.len() {
            call_between();
            return Err(crate::error::Error::arg(
                "prefix",
                format!("{} prefixes for {} objects", prefix.len(), objs.len()),
            ));
        }
        let stored = match self.stored_names(objs.iter().map(|o| o.0), false) {
            Ok(s) => s,
            Err(e) => {
                call_between();
                return Err(e);
            }
        };
        let renamed = stored.as_deref().map(|n| renamed(objs, n));
        let objs = renamed.as_deref().unwrap_or(objs);
        // SAFETY: the caller's guarantee, passed on (renaming keeps every range).
        let got = unsafe { self.get_passes(objs, prefix, &mut call_between) };
        call_between();
        got
    }

    /// The body of [`Shared::get_in_two`] (which checks `prefix` and calls `between` once on every path).
    ///
    /// # Safety
    /// As [`Shared::get`].
    unsafe fn get_passes(
        &self,
        objs: &[(&str, usize, u64)],
        prefix: &[u64],
        between: &mut dyn FnMut(),
    ) -> Result<Vec<bool>> {
        for (k, _, _) in objs {
            Self::check_key(k)?;
        }
        self.refresh_for(Some(&objs.iter().map(|o| o.0).collect::<Vec<_>>()));
        let t0 = std::time::Instant::now();
        let sealed = self.opts.keyring.is_some();
        let mut work: Vec<(usize, Entry)> = Vec::new();
        {
            let mut ix = self.log.index();
            for (i, (k, _, len)) in objs.iter().enumerate() {
                match ix.get(k).cloned() {
                    // (a clear object never answers a sealed store, nor the reverse)
                    Some(e) if e.decoded_len() == *len && e.seal.is_some() == sealed => {
                        ix.touch(k);
                        ix.map.get_mut(*k).expect("present").pins += 1;
                        work.push((i, e));
                    }
                    _ => {
                        self.stats.misses.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        let mut classes = HashMap::new();
        for (_, e) in &work {
            if let std::collections::hash_map::Entry::Vacant(v) = classes.entry(e.class) {
                if let Ok(c) = self.class(e.class) {
                    v.insert(c);
                }
            }
        }
        let keys = SealKeys::for_batch(
            self.opts.keyring.as_deref(),
            &self.namespace,
            work.iter().map(|(i, _)| objs[*i].0),
            false,
        );
        let results: Vec<AtomicU8> = (0..work.len()).map(|_| AtomicU8::new(0)).collect();
        // the first pass (two passes only for a clear store): each object's prefix, unchecked (a coded
        // object's: the chunks that cover it, read and decoded, each against its decoded crc)
        let coded: Vec<usize> = (0..work.len())
            .filter(|&j| work[j].1.coded.is_some())
            .collect();
        let split = !prefix.is_empty() && !sealed;
        let coded_reads: Vec<Mutex<Option<CodedRead>>> =
            (0..work.len()).map(|_| Mutex::new(None)).collect();
        if split {
            self.parallel(work.len(), |j| {
                let (i, ref e) = work[j];
                let (_, ptr, len) = objs[i];
                let p = prefix[i].min(len) as usize;
                let Some(c) = classes.get(&e.class) else {
                    results[j].store(IO_ERROR, Ordering::Relaxed);
                    return;
                };
                if e.coded.is_some() {
                    match self.read_coded_prefix(e, objs[i], c, p) {
                        Ok(st) => {
                            *coded_reads[j].lock().unwrap_or_else(|p| p.into_inner()) = Some(st)
                        }
                        Err(r) => results[j].store(r, Ordering::Relaxed),
                    }
                    return;
                }
                // SAFETY: the caller guarantees [ptr, ptr+len) is writable and exclusively ours; p <= len.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, p) };
                let off = u64::from(e.slot) * u64::from(e.class);
                if fault::check("data_read")
                    .and_then(|()| c.read(buf, off))
                    .is_err()
                {
                    results[j].store(IO_ERROR, Ordering::Relaxed);
                }
            });
            between();
        }
        // the rest of each object (all of it in one pass) in pieces of at most PIECE bytes, each read and
        // summed by one worker, so sums run beside other reads; a two-pass object's prefix is summed, not read
        let mut pieces: Vec<(usize, u64, u64, bool)> = Vec::new(); // (j, start, end, read)
        for (j, (i, e)) in work.iter().enumerate() {
            if !classes.contains_key(&e.class) {
                results[j].store(IO_ERROR, Ordering::Relaxed);
            }
            if e.coded.is_some() {
                continue; // read, checked and decoded by a task of its own (below)
            }
            let len = objs[*i].2;
            let skip = if split { prefix[*i].min(len) } else { 0 };
            cut_pieces(&mut pieces, j, 0, skip, false);
            cut_pieces(&mut pieces, j, skip, len, true);
        }
        let sums: Vec<AtomicU32> = (0..pieces.len()).map(|_| AtomicU32::new(0)).collect();
        // the pieces, then the coded objects, each one task (reads beside other tasks' decoding)
        self.parallel(pieces.len() + coded.len(), |p| {
            if p >= pieces.len() {
                let j = coded[p - pieces.len()];
                let (i, ref e) = work[j];
                if results[j].load(Ordering::Relaxed) == 0 {
                    let first = coded_reads[j]
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .take();
                    let r = match classes.get(&e.class) {
                        None => IO_ERROR,
                        Some(c) => self.read_coded(e, objs[i], c, keys.as_ref(), first),
                    };
                    results[j].store(r, Ordering::Relaxed);
                }
                return;
            }
            let (j, a, b, read) = pieces[p];
            let (i, ref e) = work[j];
            let ptr = objs[i].1;
            if results[j].load(Ordering::Relaxed) != 0 {
                return; // (a pass of it failed)
            }
            let (at, n) = ((ptr + a as usize) as *mut u8, (b - a) as usize);
            if read {
                // The caller guarantees [ptr, ptr+len) is writable and ours for the call, and a <= b <= len.
                // SAFETY: no other piece covers [a, b), so this is the only reference to these bytes.
                let buf = unsafe { std::slice::from_raw_parts_mut(at, n) };
                let off = u64::from(e.slot) * u64::from(e.class) + a;
                let got = match classes.get(&e.class) {
                    Some(c) => fault::check("data_read").and_then(|()| c.read(buf, off)),
                    None => Err(std::io::Error::from_raw_os_error(libc::EIO)),
                };
                if got.is_err() {
                    results[j].store(IO_ERROR, Ordering::Relaxed);
                    return;
                }
            }
            // A piece of the first pass (`read == false`) was written before this pass; others may read it.
            // SAFETY: in range as above, and no &mut to these bytes is live (the read branch's has ended).
            let buf = unsafe { std::slice::from_raw_parts(at.cast_const(), n) };
            sums[p].store(crate::hash::piece_crc(buf), Ordering::Relaxed);
        });
        // each object whole: its pieces' sums joined against the journal's; sealed: opened in place
        let mut first = 0;
        let mut whole = vec![false; work.len()];
        for (j, (i, e)) in work.iter().enumerate() {
            let n = pieces[first..].iter().take_while(|p| p.0 == j).count();
            let of: Vec<(u32, usize)> = (first..first + n)
                .map(|p| {
                    (
                        sums[p].load(Ordering::Relaxed),
                        (pieces[p].2 - pieces[p].1) as usize,
                    )
                })
                .collect();
            first += n;
            if results[j].load(Ordering::Relaxed) != 0 {
                continue;
            }
            if crate::hash::object_crc_of_pieces(&of, objs[*i].0) != e.crc {
                results[j].store(CORRUPT, Ordering::Relaxed);
            } else if keys.is_none() {
                results[j].store(OK, Ordering::Relaxed);
            } else {
                whole[j] = true;
            }
        }
        if let (Some(k), true) = (&keys, whole.contains(&true)) {
            self.parallel(work.len(), |j| {
                let (i, ref e) = work[j];
                let (key, ptr, len) = objs[i];
                let Some(seal) = e.seal.as_ref().filter(|_| whole[j]) else {
                    return;
                };
                // SAFETY: as above; the pieces' workers are done with it.
                let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len as usize) };
                // a tag that does not verify is corrupt, a tenant without a key here now (erased, or its
                // key file unreadable for a moment) a miss that keeps the object
                let r = match k.open(key, buf, seal) {
                    Opened::Ok => OK,
                    Opened::NoKey => NO_KEY,
                    Opened::Stale => STALE,
                    Opened::Failed => CORRUPT,
                };
                results[j].store(r, Ordering::Relaxed);
            });
        }
        let mut ok = vec![false; objs.len()];
        let mut corrupt = Vec::new();
        let mut bytes = 0;
        {
            let mut ix = self.log.index();
            for (j, (i, e)) in work.iter().enumerate() {
                let key = objs[*i].0;
                ix.unpin(key, e.class, e.slot);
                match results[j].load(Ordering::Relaxed) {
                    OK => {
                        ok[*i] = true;
                        bytes += e.decoded_len();
                    }
                    CORRUPT => {
                        corrupt.push((key.to_owned(), e.gen));
                        self.stats.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                    }
                    NO_KEY => {
                        self.stats.misses.fetch_add(1, Ordering::Relaxed);
                    }
                    STALE => {
                        // its key was destroyed: a miss, and the object goes (it can never open again)
                        self.stats.misses.fetch_add(1, Ordering::Relaxed);
                        corrupt.push((key.to_owned(), e.gen));
                    }
                    _ => {
                        self.stats.read_failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        self.drop_corrupt(&corrupt);
        self.stats
            .hits
            .fetch_add(ok.iter().filter(|&&b| b).count() as u64, Ordering::Relaxed);
        self.stats.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.stats
            .get_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.persist_stats(false);
        Ok(ok)
    }

    /// Drops objects that failed their checksum (only if each is still the object that was read: a key
    /// re-put meanwhile is a new object); those whose del record cannot be logged are marked bad instead.
    fn drop_corrupt(&self, bad: &[(String, u64)]) {
        if bad.is_empty() {
            return;
        }
        let dropped = if self.read_only {
            Err(())
        } else {
            self.commit_dels(bad).map_err(|_| ())
        };
        if dropped.is_err() {
            let mut ix = self.log.index();
            for (k, g) in bad {
                ix.mark_bad(k, *g);
            }
        }
    }

    /// Whether each key is stored and servable: a clear object does not count in a sealed store, nor the
    /// reverse, nor an object sealed under a tenant key that is not there now (erased, or replaced).
    pub fn exists(&self, keys: &[&str]) -> Vec<bool> {
        match self.stored_names(keys.iter().copied(), false) {
            Ok(Some(names)) => {
                self.exists_stored(&names.iter().map(String::as_str).collect::<Vec<_>>())
            }
            Ok(None) => self.exists_stored(keys),
            Err(_) => vec![false; keys.len()], // a key no object can have
        }
    }

    /// [`Shared::exists`] of names as the store keeps them.
    fn exists_stored(&self, keys: &[&str]) -> Vec<bool> {
        self.refresh_for(Some(keys));
        // sealed: only objects its tenant's current key can open count (a lookup promises what a read serves)
        let seal = SealKeys::for_batch(
            self.opts.keyring.as_deref(),
            &self.namespace,
            keys.iter().copied(),
            false,
        );
        let ix = self.log.index();
        keys.iter()
            .map(|k| {
                ix.get(k).is_some_and(|e| match &seal {
                    Some(s) => s.current(k, e.seal.as_deref()),
                    None => e.seal.is_none(),
                })
            })
            .collect()
    }

    /// Length of the stored object `key`, if any.
    pub fn len_of(&self, key: &str) -> Option<u64> {
        let stored = self.stored_names(std::iter::once(key), false).ok()?;
        let key = stored.as_ref().map_or(key, |n| n[0].as_str());
        self.refresh_for(Some(&[key]));
        self.log.index().get(key).map(Entry::decoded_len)
    }

    /// Re-reads every object and checks its checksum. With `repair` (writable stores only), corrupt and
    /// unreadable objects are deleted and the journal is compacted (removing damaged spans and dropped
    /// records).
    pub fn verify(&self, repair: bool) -> Result<VerifyReport> {
        self.refresh_for(None);
        let keys: Vec<String> = self.log.index().map.keys().map(|k| k.to_string()).collect();
        self.stats.verify_done.store(0, Ordering::Relaxed);
        self.stats
            .verify_total
            .store(keys.len() as u64, Ordering::Relaxed);
        let mut rep = VerifyReport::default();
        let mut bad: Vec<(String, u64)> = Vec::new();
        let mut buf = Vec::new();
        for k in keys {
            self.stats.verify_done.fetch_add(1, Ordering::Relaxed);
            // pinned while read, so its slot cannot be reused under the read (a live store)
            let e = {
                let mut ix = self.log.index();
                let Some(e) = ix.map.get_mut(k.as_str()) else {
                    continue;
                };
                e.pins += 1;
                e.clone()
            };
            rep.checked += 1;
            let off = u64::from(e.slot) * u64::from(e.class);
            buf.resize(e.len as usize, 0);
            let read = self.class(e.class).map_err(|_| ()).and_then(|c| {
                std::os::unix::fs::FileExt::read_exact_at(&c.buffered, &mut buf, off)
                    .map_err(|_| ())
            });
            self.log.index().unpin(&k, e.class, e.slot);
            // a coded object in clear decodes too (every chunk against its crc); a sealed one cannot be
            // opened here, so its stored bytes are what is checked
            let decodes = |buf: &[u8]| match e.coded {
                Some(n) if e.seal.is_none() => {
                    let mut out = vec![0u8; n.get() as usize];
                    crate::codec::decode(buf, &mut out).is_ok()
                }
                _ => true,
            };
            match read {
                Err(()) => rep.unreadable.push(k.clone()),
                Ok(()) if crate::hash::object_crc(&buf, &k) != e.crc || !decodes(&buf) => {
                    rep.corrupt.push(k.clone())
                }
                Ok(()) => continue,
            }
            bad.push((k, e.gen));
        }
        if repair {
            self.commit_dels(&bad)
                .map_err(|e| crate::store::io_err("appending del records to journal.log", e))?;
            self.compact()?;
        }
        Ok(rep)
    }
}

/// Appends the pieces of `[a, b)` of work item `j`: at most [`crate::hash::PIECE`] bytes each, the first
/// ending on a multiple of it (so O_DIRECT reads stay aligned). An empty range to read is one empty piece
/// (a read of nothing, as every object's last pass has been: fault tests count on one read per object and
/// pass); an empty range to sum, none.
fn cut_pieces(out: &mut Vec<(usize, u64, u64, bool)>, j: usize, a: u64, b: u64, read: bool) {
    let piece = crate::hash::PIECE as u64;
    if read && a == b {
        out.push((j, a, b, read));
    }
    let mut at = a;
    while at < b {
        let end = ((at / piece + 1) * piece).min(b);
        out.push((j, at, end, read));
        at = end;
    }
}

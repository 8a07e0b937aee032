//! The in-memory index: keys to entries, LRU order, the state of every slot, and the occupancy the
//! capacity limit is checked against (docs/STORE.md, "In memory").

pub(super) mod entry;
pub(super) mod fasthash;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use super::journal::encoded_len;
use fasthash::FastMap;

/// Bytes the journal keeps beyond the prepaid del records (R4).
pub(super) const JOURNAL_SLACK: u64 = 4096;

/// Journal bytes a put reserves in the capacity until it commits: what the journal budget grows by when
/// its record commits, at most — its prepaid del and the allowance its record earns (1.25 × 2 records,
/// plus a byte of rounding): 3.5 records (docs/STORE.md, "Capacity, exactly"). Evicting an object gives
/// as much back while the journal is within its allowance, so a full store evicts one object per object
/// it takes, however many batches it runs.
pub(super) fn put_journal_cost(key_len: usize, parts: super::journal::PutParts) -> u64 {
    let rec = super::journal::put_len(key_len, parts);
    (7 * rec as u64).div_ceil(2) + 1
}

/// Most keys a writer's index map is sized for at open.
const PRESIZE_MAX: u64 = 1 << 23;

/// Keys a writer's index map is sized for at open: the most objects `capacity` can hold (every class is a
/// multiple of 4096), at most 8M. A map that grows doubles, rehashing every key under the index lock:
/// 0.1 s at half a million keys, inside a batch. Sized ahead, only its control bytes (one per bucket) are
/// touched until keys fill it; the buckets' memory is mapped as they are used.
pub(super) fn presize(capacity: u64) -> usize {
    (capacity / 4096).min(PRESIZE_MAX) as usize
}

pub(super) use entry::Entry;

#[derive(Default)]
pub(super) struct Index {
    /// Each key is one allocation, shared by the map and the LRU order.
    pub(super) map: FastMap<Arc<str>, Entry>,
    lru: BTreeMap<u64, Arc<str>>,
    tick: u64,
    gens: u64,
    /// Bytes of live and reserved slots.
    pub(super) used: u64,
    /// Over the servable entries: how many are coded, their stored lengths and what they decode to (kept as
    /// entries come and go: `stats()` asks after batches, and a walk held the lock 41 ns an entry).
    pub(super) content: (usize, u64, u64),
    /// Bytes of class-file blocks held: live, reserved, zombie and free-with-blocks slots.
    pub(super) data_alloc: u64,
    /// Free slots that still have their blocks, per class.
    pub(super) free: FastMap<u32, Vec<u32>>,
    /// Free slots without blocks (punched, or below `next` and never allocated), per class.
    pub(super) holes: FastMap<u32, Vec<u32>>,
    /// One past the highest slot ever handed out, per class.
    pub(super) next: FastMap<u32, u32>,
    /// Slots of deleted objects still pinned by a reader: freed when the last pin goes.
    zombies: FastMap<(u32, u32), u32>,
    /// Σ over live keys of a del record's size: the journal reserve that makes every delete possible.
    pub(super) del_bytes: u64,
    /// The journal's length.
    pub(super) j_end: u64,
    /// The journal's length plus its preallocated reserve.
    pub(super) j_alloc: u64,
    /// Journal bytes of put batches between their reservation and their commit (records + reserve).
    pub(super) j_pending: u64,
    /// Journal length below which it is never compacted (small journals are not worth a rewrite).
    pub(super) compact_floor: u64,
    /// Entries failed their checksum and kept (`Entry::bad`): eviction takes them first.
    bad_entries: usize,
    /// A compaction copying the live entries (see [`Walk`]).
    pub(super) walk: Option<Walk>,
}

/// A compaction's walk over the entries live when it began, oldest first, in chunks taken under the index
/// lock between commits (docs/STORE.md, "Compaction"). `pos` is the last tick copied; `end` the newest tick
/// when the walk began. An entry touched before the walk reached it moves past `end`: it is kept in
/// `touched` and copied after the walk, so every entry live at the start is copied once unless it changes
/// (and then its record is in the journal's tail, which the compaction copies after the walk).
pub(super) struct Walk {
    pos: u64,
    end: u64,
    touched: Vec<Arc<str>>,
}

impl Index {
    /// Journal bytes that must be allocated now: its length, every live key's del, the slack, and what
    /// batches in flight will append and prepay.
    pub(super) fn journal_need(&self) -> u64 {
        self.j_end + self.del_bytes + JOURNAL_SLACK + self.j_pending
    }

    /// The journal length at which a compaction starts: when its dead records are as many bytes as its
    /// live ones (the live part is `del_bytes`: a put and a del record of a key have the same size), and
    /// never below the floor.
    pub(super) fn compact_trigger(&self) -> u64 {
        (2 * self.del_bytes).max(self.compact_floor)
    }

    /// What the capacity holds for the journal: its length up to the compaction trigger plus a quarter
    /// (the records committed while a compaction runs), or more if it is longer; every live key's del
    /// (R4); the slack; and what batches in flight will add. Eviction keeps data within the capacity
    /// minus this, so the journal's garbage never has to be paid for by a compaction inside a batch.
    pub(super) fn journal_budget(&self) -> u64 {
        self.j_end.max(self.journal_allowance()) + self.del_bytes + JOURNAL_SLACK + self.j_pending
    }

    /// The journal length the budget holds room for: the compaction trigger plus a quarter.
    pub(super) fn journal_allowance(&self) -> u64 {
        let t = self.compact_trigger();
        t + t / 4
    }

    /// Occupancy if `grow` more data bytes were allocated and `journal` more journal bytes were pending
    /// (the journal in whole 4 KiB blocks, as its growth allocates them).
    pub(super) fn occupancy_with(&self, grow: u64, journal: u64) -> u64 {
        let need = (self.journal_budget() + journal).div_ceil(4096) * 4096;
        self.data_alloc + grow + self.j_alloc.max(need)
    }

    /// The servable entry of `key`.
    pub(super) fn get(&self, key: &str) -> Option<&Entry> {
        self.map.get(key).filter(|e| e.servable())
    }

    pub(super) fn touch(&mut self, key: &str) {
        self.tick += 1;
        let t = self.tick;
        if let Some(e) = self.map.get_mut(key) {
            // the LRU order holds the map's own key: take it back and put it at the new tick
            let k = self.lru.remove(&e.tick).unwrap_or_else(|| Arc::from(key));
            if let Some(w) = &mut self.walk {
                if e.tick > w.pos && e.tick <= w.end {
                    w.touched.push(k.clone()); // leaves the walk's range before it was copied
                }
            }
            e.tick = t;
            self.lru.insert(t, k);
        }
    }

    /// Entries that may be served: every entry but the bad ones (counted, not searched: `STATS` asks for
    /// it after batches, and a walk of a million entries took 9-10 ms of a put under the index lock).
    pub(super) fn servable_count(&self) -> usize {
        let n = self.map.len() - self.bad_entries;
        debug_assert_eq!(n, self.map.values().filter(|e| e.servable()).count());
        n
    }

    /// Marks the entry `key` of generation `gen` bad (failed its checksum, not dropped durably).
    pub(super) fn mark_bad(&mut self, key: &str, gen: u64) {
        if let Some(e) = self.map.get_mut(key) {
            if e.gen == gen && !e.bad {
                e.bad = true;
                self.bad_entries += 1;
                let e = e.clone();
                self.account(&e, false);
            }
        }
    }

    /// Replay's index build: [`insert`](Self::insert) of each of the `n` entries, oldest first, into an empty index
    /// whose keys are distinct, with the LRU order built at once from the ticks in order (a bulk build)
    /// instead of one tree insert per key.
    pub(super) fn load<'k>(&mut self, n: usize, entries: impl Iterator<Item = (&'k str, Entry)>) {
        debug_assert!(self.map.is_empty() && self.lru.is_empty());
        self.map.reserve(n);
        let mut order = Vec::with_capacity(n);
        for (key, mut e) in entries {
            self.tick += 1;
            self.gens += 1;
            e.tick = self.tick;
            e.gen = self.gens;
            self.del_bytes += encoded_len(key.len()) as u64;
            self.account(&e, true);
            let key: Arc<str> = Arc::from(key);
            order.push((e.tick, key.clone()));
            let old = self.map.insert(key, e);
            debug_assert!(old.is_none(), "replay's keys are distinct");
        }
        // ticks ascending: `BTreeMap`'s collect builds the tree from the sorted run in one pass
        self.lru = order.into_iter().collect();
    }

    /// Inserts an entry whose slot is already counted (reserved, or replayed); a previous entry of the key
    /// is superseded and its slot released. Returns the previous entry.
    pub(super) fn insert(&mut self, key: &str, mut e: Entry) -> Option<Entry> {
        self.tick += 1;
        self.gens += 1;
        e.tick = self.tick;
        e.gen = self.gens;
        let dl = encoded_len(key.len()) as u64;
        // a key already present keeps its allocation (the map keeps its key on insert)
        let key = match self.map.get_key_value(key) {
            Some((k, _)) => k.clone(),
            None => Arc::from(key),
        };
        self.lru.insert(e.tick, key.clone());
        self.account(&e, true);
        let old = self.map.insert(key, e);
        match &old {
            Some(o) => {
                self.lru.remove(&o.tick);
                self.bad_entries -= usize::from(o.bad);
                if !o.bad {
                    self.account(o, false);
                }
                self.release(o);
            }
            None => self.del_bytes += dl,
        }
        old
    }

    /// Removes `key`; its slot becomes free (or a zombie while pinned).
    pub(super) fn remove(&mut self, key: &str) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.lru.remove(&e.tick);
        self.del_bytes -= encoded_len(key.len()) as u64;
        self.bad_entries -= usize::from(e.bad);
        if !e.bad {
            self.account(&e, false);
        }
        self.release(&e);
        Some(e)
    }

    /// Adds (`add`) or takes away a servable entry's part of [`Index::content`].
    fn account(&mut self, e: &Entry, add: bool) {
        let (n, s, d) = (usize::from(e.coded.is_some()), e.len, e.decoded_len());
        let c = &mut self.content;
        if add {
            *c = (c.0 + n, c.1 + s, c.2 + d);
        } else {
            *c = (c.0 - n, c.1 - s, c.2 - d);
        }
    }

    fn release(&mut self, e: &Entry) {
        self.used -= u64::from(e.class);
        if e.pins > 0 {
            self.zombies.insert((e.class, e.slot), e.pins);
        } else {
            self.free.entry(e.class).or_default().push(e.slot);
        }
    }

    /// A free slot of `class` that still has its blocks, reserved.
    pub(super) fn reuse_slot(&mut self, class: u32) -> Option<u32> {
        let s = self.free.get_mut(&class)?.pop()?;
        self.used += u64::from(class);
        Some(s)
    }

    /// A slot of `class` that needs new blocks (a hole, or the next slot at the end), reserved and counted.
    pub(super) fn grow_slot(&mut self, class: u32) -> u32 {
        self.used += u64::from(class);
        self.data_alloc += u64::from(class);
        if let Some(s) = self.holes.get_mut(&class).and_then(|v| v.pop()) {
            return s;
        }
        let n = self.next.entry(class).or_insert(0);
        *n += 1;
        *n - 1
    }

    /// A reserved slot whose object was not stored; its blocks stay (free with blocks).
    pub(super) fn unreserve(&mut self, class: u32, slot: u32) {
        self.used -= u64::from(class);
        self.free.entry(class).or_default().push(slot);
    }

    /// A reserved slot whose blocks could not be allocated: back to the holes.
    pub(super) fn unreserve_unallocated(&mut self, class: u32, slot: u32) {
        self.used -= u64::from(class);
        self.data_alloc -= u64::from(class);
        self.holes.entry(class).or_default().push(slot);
    }

    /// Takes free-with-blocks slots to be punched: of each class all but `keep` of them (`keep` lists
    /// `(class, slots still wanted)`), so the slots a waiting object can reuse stay.
    pub(super) fn take_punchable(&mut self, keep: &[(u32, usize)]) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for (&class, v) in self.free.iter_mut() {
            let k = keep
                .iter()
                .filter(|c| c.0 == class)
                .map(|c| c.1)
                .sum::<usize>();
            if v.len() > k {
                // the list pops from its end: keep the end, punch the front
                let n = v.len() - k;
                out.extend(v.drain(..n).map(|s| (class, s)));
            }
        }
        out
    }

    /// Slots taken with [`Index::take_punchable`]: punched (blocks gone) or not (back to free).
    pub(super) fn punched(&mut self, slots: &[(u32, u32)], ok: bool) {
        for &(class, slot) in slots {
            if ok {
                self.data_alloc -= u64::from(class);
                self.holes.entry(class).or_default().push(slot);
            } else {
                self.free.entry(class).or_default().push(slot);
            }
        }
    }

    pub(super) fn unpin(&mut self, key: &str, class: u32, slot: u32) {
        if let Some(e) = self.map.get_mut(key) {
            if e.class == class && e.slot == slot && e.pins > 0 {
                e.pins -= 1;
                return;
            }
        }
        if let Some(p) = self.zombies.get_mut(&(class, slot)) {
            *p -= 1;
            if *p == 0 {
                self.zombies.remove(&(class, slot));
                self.free.entry(class).or_default().push(slot);
            }
        }
    }

    /// Eviction candidates covering `bytes` of slots: bad entries first, then least recently used; pinned
    /// entries and `exclude`d keys are skipped, and with `only` just that size class is taken (where
    /// freed blocks cannot be punched, only a slot of the wanted class makes room). A page's K and V
    /// objects (`<key>.k`, `<key>.v`) go together: half a page is no use to anyone. Each is `(key, gen)`.
    pub(super) fn victims(
        &self,
        bytes: u64,
        exclude: &HashSet<&str>,
        only: Option<u32>,
    ) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = Vec::new();
        let mut taken: HashSet<&str> = HashSet::new();
        let mut got = 0u64;
        // bad entries are rare: the whole map is searched for them only when there are some
        let bad = self
            .map
            .iter()
            .take(if self.bad_entries > 0 { usize::MAX } else { 0 })
            .filter(|(_, e)| e.bad);
        let lru = self.lru.values().filter_map(|k| self.map.get_key_value(k));
        let evictable = |k: &str, e: &Entry| {
            e.pins == 0 && !exclude.contains(k) && only.is_none_or(|c| c == e.class)
        };
        for (k, e) in bad.chain(lru.filter(|(_, e)| !e.bad)) {
            if got >= bytes.max(1) {
                break;
            }
            if !evictable(k, e) || !taken.insert(k) {
                continue;
            }
            out.push((k.to_string(), e.gen));
            got += u64::from(e.class);
            if let Some(sib) = sibling(k) {
                if let Some((sk, se)) = self.map.get_key_value(sib.as_str()) {
                    if se.pins == 0 && !exclude.contains(&**sk) && taken.insert(sk) {
                        out.push((sk.to_string(), se.gen));
                        got += u64::from(se.class);
                    }
                }
            }
        }
        out
    }

    /// Starts a compaction's walk over the entries live now.
    pub(super) fn start_walk(&mut self) {
        self.walk = Some(Walk {
            pos: 0,
            end: self.tick,
            touched: Vec::new(),
        });
    }

    /// Appends put records of up to `max` more entries of the walk to `out`, oldest first, then those
    /// touched before the walk reached them. A bad entry is left out: the new journal does not bring it
    /// back. Returns whether the walk is done (then it is ended).
    pub(super) fn walk_chunk(&mut self, max: usize, out: &mut Vec<u8>) -> bool {
        let Some(w) = &mut self.walk else {
            return true;
        };
        let mut n = 0;
        let put = |k: &str, e: &Entry, out: &mut Vec<u8>| {
            if e.servable() {
                super::journal::encode_put(out, k, &e.placement());
            }
        };
        let range = if w.pos < w.end {
            self.lru.range(w.pos + 1..=w.end)
        } else {
            self.lru.range(1..1) // nothing left (an empty range; a reversed one would panic)
        };
        for (&t, k) in range {
            if n == max {
                return false;
            }
            put(k, &self.map[k], out);
            w.pos = t;
            n += 1;
        }
        w.pos = w.end;
        while let Some(k) = w.touched.pop() {
            // a key removed since is not live; one put again since has its record in the tail
            if let Some(e) = self.map.get(&k) {
                put(&k, e, out);
            }
            n += 1;
            if n == max && !w.touched.is_empty() {
                return false;
            }
        }
        self.walk = None;
        true
    }
}

/// The other half of a page object: `<key>.v` for `<key>.k` and the reverse.
fn sibling(key: &str) -> Option<String> {
    if let Some(base) = key.strip_suffix(".k") {
        Some(format!("{base}.v"))
    } else {
        key.strip_suffix(".v").map(|base| format!("{base}.k"))
    }
}

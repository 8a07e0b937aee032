//! The page store: durable, checksummed, capacity-bounded storage of KV page objects on a local disk or a
//! shared file system, with O_DIRECT IO straight from and into the caller's (pinned, aligned) memory.
//!
//! Layout of one namespace (a directory under the store root, owner-only):
//!
//! ```text
//! ns-<sha256(namespace)[..16]>/
//!   NAMESPACE        the full namespace string (guards against hash collisions)
//!   LOCK             flock'ed exclusively while open: a second writer is refused
//!   journal.log      put/del records (see `journal`), the index's only source of truth
//!   class-<N>.dat    fixed-size slots of N bytes (N = object length rounded up to 4096)
//! ```
//!
//! Keys are data, never paths: they only appear inside journal records.
//!
//! Durability protocol of [`PageStore::put`]: (1) slots are reserved, evicting least-recently-used objects
//! if needed; their `del` records are made durable *before* a slot is reused; (2) object bytes are written
//! (in parallel, O_DIRECT when the memory and length are 4096-aligned) and the data files are
//! `fdatasync`ed; (3) `put` records are appended and the journal is `fdatasync`ed; only then does the call
//! report success. A crash at any point leaves every acknowledged object intact; an object whose record is
//! missing or torn never existed. Every record carries crc32c(bytes ‖ key), verified on every read: a
//! mismatch is a miss, counted, and the object is dropped — wrong bytes are never reported as loaded.
//! Reads pin their objects, so eviction or deletion never hands a slot that is being read to a writer.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::journal::{self, Record};

const ALIGN: u64 = 4096;
/// Largest object: its size class (the length rounded up to 4 KiB) must fit the journal's 32-bit field.
pub const MAX_OBJECT: u64 = (1 << 32) - ALIGN;

/// Options of [`PageStore::open`].
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Hard limit on the bytes of all slots in use.
    pub capacity_bytes: u64,
    /// Threads doing IO in parallel for one batch (the queue depth).
    pub io_threads: usize,
    /// `Some(false)` disables O_DIRECT; `None` probes it.
    pub direct: Option<bool>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            capacity_bytes: 64 << 30,
            io_threads: 16,
            direct: None,
        }
    }
}

/// Counters reported by [`PageStore::stats`].
#[derive(Debug, Default)]
pub struct Stats {
    /// Objects written (acknowledged).
    pub puts: AtomicU64,
    /// Bytes written (acknowledged objects).
    pub bytes_written: AtomicU64,
    /// Nanoseconds spent in put batches (wall).
    pub put_ns: AtomicU64,
    /// Objects read and verified.
    pub hits: AtomicU64,
    /// Lookups that found nothing.
    pub misses: AtomicU64,
    /// Bytes read (verified objects).
    pub bytes_read: AtomicU64,
    /// Nanoseconds spent in get batches (wall).
    pub get_ns: AtomicU64,
    /// Objects evicted to stay under capacity.
    pub evictions: AtomicU64,
    /// Reads whose checksum or length did not match (object dropped).
    pub corrupt_reads: AtomicU64,
    /// Objects whose write failed (IO error, ENOSPC, capacity).
    pub write_failures: AtomicU64,
    /// Reads that failed with an IO error.
    pub read_failures: AtomicU64,
    /// Journal records dropped at open because they named no bytes the store could have written (an
    /// object past its class file's end, a length outside its class).
    pub dropped_records: AtomicU64,
}

#[derive(Clone, Debug)]
struct Entry {
    class: u32,
    slot: u32,
    len: u64,
    crc: u32,
    tick: u64,
    pins: u32,
}

#[derive(Default)]
struct Index {
    map: HashMap<String, Entry>,
    lru: BTreeMap<u64, String>,
    tick: u64,
    used: u64,
    free: HashMap<u32, Vec<u32>>,
    next: HashMap<u32, u32>,
    /// Slots of deleted objects still pinned by a reader: freed when the last pin goes.
    zombies: HashMap<(u32, u32), u32>,
}

impl Index {
    fn touch(&mut self, key: &str) {
        self.tick += 1;
        let t = self.tick;
        if let Some(e) = self.map.get_mut(key) {
            self.lru.remove(&e.tick);
            e.tick = t;
            self.lru.insert(t, key.to_owned());
        }
    }

    fn insert(&mut self, key: String, mut e: Entry) -> Option<Entry> {
        self.tick += 1;
        e.tick = self.tick;
        self.used += e.class as u64;
        self.lru.insert(e.tick, key.clone());
        let old = self.map.insert(key, e);
        if let Some(o) = &old {
            self.lru.remove(&o.tick);
            self.release(o);
        }
        old
    }

    /// Removes `key`; its slot becomes free (or a zombie while pinned).
    fn remove(&mut self, key: &str) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.lru.remove(&e.tick);
        self.release(&e);
        Some(e)
    }

    fn release(&mut self, e: &Entry) {
        self.used -= e.class as u64;
        if e.pins > 0 {
            self.zombies.insert((e.class, e.slot), e.pins);
        } else {
            self.free.entry(e.class).or_default().push(e.slot);
        }
    }

    fn take_slot(&mut self, class: u32) -> u32 {
        if let Some(s) = self.free.get_mut(&class).and_then(|v| v.pop()) {
            return s;
        }
        let n = self.next.entry(class).or_insert(0);
        *n += 1;
        *n - 1
    }

    fn unpin(&mut self, key: &str, class: u32, slot: u32) {
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
}

struct Class {
    buffered: File,
    direct: Option<File>,
    path: PathBuf,
    /// Bytes allocated on disk (fallocate'd).
    allocated: Mutex<u64>,
}

/// One open namespace of a page store. Thread-safe; every method takes `&self`.
pub struct PageStore {
    dir: PathBuf,
    namespace: String,
    opts: StoreOptions,
    direct: bool,
    direct_note: Option<String>,
    _lock: File,
    index: Mutex<Index>,
    journal: Mutex<File>,
    classes: Mutex<HashMap<u32, Arc<Class>>>,
    /// Counters.
    pub stats: Stats,
    recovered_tail: u64,
}

fn io_err(what: impl Into<String>, e: std::io::Error) -> Error {
    Error::Os {
        what: what.into(),
        source: e,
    }
}

/// The directory name of `namespace` under the store root.
pub fn namespace_dir(namespace: &str) -> String {
    let h = crate::hash::sha256_hex(namespace.as_bytes());
    format!("ns-{}", &h[..16])
}

/// Creates `p` (mode 0700) or checks that the existing one is a real directory — not a symlink someone
/// planted to redirect the store — owned by this process's user; then makes it owner-only.
fn owner_only_dir(p: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(format!("creating {}", p.display()), e)),
    }
    let md =
        std::fs::symlink_metadata(p).map_err(|e| io_err(format!("stat {}", p.display()), e))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if !md.file_type().is_dir() || md.uid() != euid {
        return Err(Error::arg(
            "path",
            format!(
                "{} must be a directory (not a symlink) owned by this user (uid {euid}); found {} owned by uid {}",
                p.display(),
                if md.file_type().is_symlink() { "a symlink" } else if md.is_dir() { "a directory" } else { "a file" },
                md.uid()
            ),
        ));
    }
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io_err(format!("chmod {}", p.display()), e))
}

fn open_rw(p: &Path, extra: i32) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(extra)
        .open(p)
}

/// Probes whether `dir`'s file system accepts O_DIRECT for an aligned write and read.
fn probe_direct(dir: &Path) -> std::result::Result<(), String> {
    let p = dir.join(".odirect-probe");
    let r = (|| -> std::io::Result<()> {
        let f = open_rw(&p, libc::O_DIRECT)?;
        let buf = crate::buffer::HostRegion::new(
            4096,
            &crate::buffer::RegionOptions {
                prefault_threads: Some(0),
                huge_pages: crate::buffer::HugePages::Off,
                ..Default::default()
            },
        )
        .map_err(|e| std::io::Error::other(e.to_string()))?;
        // SAFETY: the region owns 4096 bytes at as_ptr().
        let s = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), 4096) };
        f.write_all_at(s, 0)?;
        f.read_exact_at(s, 0)?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&p);
    r.map_err(|e| e.to_string())
}

impl PageStore {
    /// Opens (creating if needed) `namespace` under `root`, replaying its journal.
    pub fn open(root: &Path, namespace: &str, opts: StoreOptions) -> Result<Self> {
        if namespace.is_empty() {
            return Err(Error::arg("namespace", "must not be empty"));
        }
        if opts.capacity_bytes < ALIGN {
            return Err(Error::arg(
                "capacity_bytes",
                format!("must be >= {ALIGN}, got {}", opts.capacity_bytes),
            ));
        }
        if opts.io_threads == 0 {
            return Err(Error::arg("io_threads", "must be >= 1"));
        }
        // directories this creates are owner-only; existing parents are left as they are
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(root)
            .map_err(|e| io_err(format!("creating {}", root.display()), e))?;
        let dir = root.join(namespace_dir(namespace));
        owner_only_dir(&dir)?;
        // the lock first: two processes creating one namespace must not race on NAMESPACE.tmp
        let lock = open_rw(&dir.join("LOCK"), 0).map_err(|e| io_err("opening LOCK", e))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        } != 0
        {
            return Err(Error::Os {
                what: format!(
                    "namespace {namespace:?} at {} is already open for writing (LOCK held)",
                    dir.display()
                ),
                source: std::io::Error::last_os_error(),
            });
        }
        let ns_file = dir.join("NAMESPACE");
        match std::fs::read(&ns_file) {
            Ok(s) if s == namespace.as_bytes() => {}
            // anything else there (another namespace, bytes that are not even UTF-8) is not ours to reuse
            Ok(s) => {
                return Err(Error::arg(
                    "namespace",
                    format!(
                        "directory {} belongs to namespace {:?}, not {namespace:?}",
                        dir.display(),
                        String::from_utf8_lossy(&s)
                    ),
                ))
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_err(format!("reading {}", ns_file.display()), e))
            }
            Err(_) => {
                let tmp = dir.join("NAMESPACE.tmp");
                (|| -> std::io::Result<()> {
                    // a leftover (or planted) NAMESPACE.tmp is replaced, never followed: a symlink there
                    // would otherwise let the truncation below hit the file it points to
                    match std::fs::remove_file(&tmp) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                        _ => {}
                    }
                    let f = open_rw(&tmp, libc::O_NOFOLLOW | libc::O_EXCL)?; // new, 0600 whatever the umask
                    f.write_all_at(namespace.as_bytes(), 0)?;
                    f.sync_data()
                })()
                .map_err(|e| io_err("writing NAMESPACE", e))?;
                std::fs::rename(&tmp, &ns_file).map_err(|e| io_err("publishing NAMESPACE", e))?;
            }
        }
        let (direct, direct_note) = match opts.direct {
            Some(false) => (
                false,
                Some("O_DIRECT disabled by the caller; using buffered IO".to_owned()),
            ),
            _ => match probe_direct(&dir) {
                Ok(()) => (true, None),
                Err(e) if opts.direct == Some(true) => {
                    return Err(Error::Os {
                        what: format!("O_DIRECT required but refused here: {e}"),
                        source: std::io::Error::from_raw_os_error(libc::EINVAL),
                    })
                }
                Err(e) => (
                    false,
                    Some(format!(
                        "the file system refused O_DIRECT ({e}); using buffered IO with fdatasync"
                    )),
                ),
            },
        };
        let jpath = dir.join("journal.log");
        let mut journal = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&jpath)
            .map_err(|e| io_err("opening journal.log", e))?;
        let mut bytes = Vec::new();
        journal
            .read_to_end(&mut bytes)
            .map_err(|e| io_err("reading journal.log", e))?;
        let (records, valid) = journal::parse(&bytes);
        let mut dropped_records = 0u64;
        // keys whose latest record was dropped (a later put or delete of the key takes it out again)
        let mut dropped: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        let recovered_tail = (bytes.len() - valid) as u64;
        if recovered_tail > 0 {
            journal
                .set_len(valid as u64)
                .map_err(|e| io_err("truncating a torn journal tail", e))?;
            journal
                .sync_all()
                .map_err(|e| io_err("syncing journal.log", e))?;
        }
        let mut index = Index::default();
        // A record can only name bytes the store once wrote: an object that lies inside its class file, a
        // length within its class. Anything else (a record this store never wrote, a truncated
        // data file) names no object: it is dropped, and never sizes a free list or a read buffer.
        let mut file_len: HashMap<u32, u64> = HashMap::new();
        for r in records {
            match r {
                Record::Put {
                    key,
                    class,
                    slot,
                    len,
                    crc,
                } => {
                    let flen = match file_len.get(&class) {
                        Some(&n) => n,
                        None => {
                            // only a missing (or non-file) class file has no bytes; any other error fails
                            // the open rather than dropping every record of the class
                            let p = dir.join(format!("class-{class}.dat"));
                            let n = match std::fs::symlink_metadata(&p) {
                                Ok(m) if m.is_file() => m.len(),
                                Ok(_) => 0,
                                Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                                Err(e) => return Err(io_err(format!("stat {}", p.display()), e)),
                            };
                            file_len.insert(class, n);
                            n
                        }
                    };
                    let plausible = u64::from(class) % ALIGN == 0
                        && class > 0
                        && len > 0
                        && len <= u64::from(class)
                        && u64::from(slot) * u64::from(class) + len <= flen;
                    if !plausible {
                        index.remove(&key);
                        dropped_records += 1;
                        dropped.insert(key);
                        continue;
                    }
                    dropped.remove(&key);
                    let n = index.next.entry(class).or_insert(0);
                    *n = (*n).max(slot + 1);
                    index.insert(
                        key,
                        Entry {
                            class,
                            slot,
                            len,
                            crc,
                            tick: 0,
                            pins: 0,
                        },
                    );
                }
                Record::Del { key } => {
                    dropped.remove(&key);
                    index.remove(&key);
                }
            }
        }
        // Slots below `next` that no live entry uses are free (their objects were deleted or superseded).
        let mut used: HashMap<u32, std::collections::HashSet<u32>> = HashMap::new();
        for e in index.map.values() {
            used.entry(e.class).or_default().insert(e.slot);
        }
        index.free.clear();
        for (&class, &next) in &index.next {
            let u = used.get(&class);
            let free: Vec<u32> = (0..next)
                .rev()
                .filter(|s| u.is_none_or(|u| !u.contains(s)))
                .collect();
            index.free.insert(class, free);
        }
        // Compaction at open: a journal much larger than its live records (every put and delete is appended)
        // is rewritten as one put per live object, atomically (write, fsync, rename, fsync the directory).
        let live_bytes: usize = index.map.keys().map(|k| k.len() + 48).sum();
        if valid > (1 << 20) && valid > 4 * live_bytes.max(1) {
            journal = compact(&dir, &jpath, &index)?;
        }
        let store = Self {
            dir,
            namespace: namespace.to_owned(),
            opts,
            direct,
            direct_note,
            _lock: lock,
            index: Mutex::new(index),
            journal: Mutex::new(journal),
            classes: Mutex::new(HashMap::new()),
            stats: Stats::default(),
            recovered_tail,
        };
        store
            .stats
            .dropped_records
            .store(dropped_records, Ordering::Relaxed);
        // A key whose latest record was dropped is deleted for good: if the record became plausible at a
        // later open (the class file grew as new objects took its slot), two entries would share a slot.
        // (After a compaction these deletes are redundant, and harmless.)
        let gone: Vec<Record> = dropped.into_iter().map(|key| Record::Del { key }).collect();
        store.append(&gone)?;
        // Honour a capacity smaller than what is stored (reopened with a lower limit).
        let evicted = store.evict_to(0)?;
        store.append(
            &evicted
                .iter()
                .map(|k| Record::Del { key: k.clone() })
                .collect::<Vec<_>>(),
        )?;
        Ok(store)
    }

    fn lock_index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The namespace directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The namespace string.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    /// True when data IO uses O_DIRECT.
    pub fn direct(&self) -> bool {
        self.direct
    }
    /// Why O_DIRECT is not used, if it is not.
    pub fn direct_note(&self) -> Option<&str> {
        self.direct_note.as_deref()
    }
    /// Bytes of a torn journal tail cut off when this store was opened.
    pub fn recovered_tail(&self) -> u64 {
        self.recovered_tail
    }
    /// The capacity limit.
    pub fn capacity(&self) -> u64 {
        self.opts.capacity_bytes
    }
    /// `(objects, bytes of slots in use)`.
    pub fn usage(&self) -> (usize, u64) {
        let ix = self.lock_index();
        (ix.map.len(), ix.used)
    }
    /// All keys (for inspection).
    pub fn keys(&self) -> Vec<String> {
        self.lock_index().map.keys().cloned().collect()
    }

    fn class(&self, class: u32) -> Result<Arc<Class>> {
        let mut cs = self.classes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cs.get(&class) {
            return Ok(c.clone());
        }
        let path = self.dir.join(format!("class-{class}.dat"));
        let buffered =
            open_rw(&path, 0).map_err(|e| io_err(format!("opening {}", path.display()), e))?;
        let direct = if self.direct {
            Some(
                open_rw(&path, libc::O_DIRECT)
                    .map_err(|e| io_err(format!("opening {} with O_DIRECT", path.display()), e))?,
            )
        } else {
            None
        };
        let len = buffered.metadata().map_err(|e| io_err("stat", e))?.len();
        let c = Arc::new(Class {
            buffered,
            direct,
            path,
            allocated: Mutex::new(len),
        });
        cs.insert(class, c.clone());
        Ok(c)
    }

    fn append(&self, recs: &[Record]) -> Result<()> {
        if recs.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(recs.len() * 96);
        for r in recs {
            r.encode(&mut buf);
        }
        let mut j = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        let before = j
            .metadata()
            .map_err(|e| io_err("stat journal.log", e))?
            .len();
        let res = crate::fault::check("journal_write")
            .and_then(|()| j.write_all(&buf))
            .and_then(|()| crate::fault::check("journal_sync"))
            .and_then(|()| j.sync_data());
        if let Err(e) = res {
            // Never leave a partial record behind a failed append: cut back to the last good length.
            let _ = j.set_len(before);
            return Err(io_err("appending to journal.log", e));
        }
        Ok(())
    }

    /// Evicts least-recently-used unpinned objects until `need` more bytes fit; returns their keys.
    fn evict_to(&self, need: u64) -> Result<Vec<String>> {
        let mut ix = self.lock_index();
        let mut out = Vec::new();
        while ix.used + need > self.opts.capacity_bytes {
            let victim = ix
                .lru
                .iter()
                .find(|(_, k)| ix.map.get(*k).is_some_and(|e| e.pins == 0))
                .map(|(_, k)| k.clone());
            let Some(k) = victim else { break };
            ix.remove(&k);
            out.push(k);
        }
        self.stats
            .evictions
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// Runs `f(i)` for `i in 0..n` on up to `io_threads` threads.
    fn parallel<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        let threads = self.opts.io_threads.min(n);
        if threads <= 1 {
            (0..n).for_each(f);
            return;
        }
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    f(i);
                });
            }
        });
    }

    fn check_key(key: &str) -> Result<()> {
        if key.is_empty() || key.len() > journal::MAX_KEY {
            return Err(Error::arg(
                "keys",
                format!(
                    "a key must have 1..={} bytes, got {}",
                    journal::MAX_KEY,
                    key.len()
                ),
            ));
        }
        Ok(())
    }

    /// Stores objects `(key, ptr, len)`; returns per object whether it is now durably stored. An object
    /// whose key already exists is left as is (keys name content) and reported stored.
    ///
    /// # Safety
    /// Each `[ptr, ptr+len)` must be readable memory that stays alive and unmodified during the call.
    pub unsafe fn put(&self, objs: &[(&str, usize, u64)]) -> Result<Vec<bool>> {
        for (k, _, len) in objs {
            Self::check_key(k)?;
            if *len == 0 || *len > MAX_OBJECT {
                return Err(Error::arg(
                    "sizes",
                    format!("object {k:?}: length must be in 1..={MAX_OBJECT}, got {len}"),
                ));
            }
        }
        let t0 = std::time::Instant::now();
        let mut ok = vec![false; objs.len()];
        // 1. reserve slots (evicting as needed); duplicates of an existing key succeed at once
        let mut plan: Vec<(usize, u32, u32)> = Vec::new(); // (obj index, class, slot)
        let mut evicted = Vec::new();
        {
            let mut seen = std::collections::HashSet::new();
            for (i, (k, _, len)) in objs.iter().enumerate() {
                let class = len.div_ceil(ALIGN) * ALIGN;
                if self.lock_index().map.contains_key(*k) || !seen.insert(*k) {
                    self.lock_index().touch(k);
                    ok[i] = true;
                    continue;
                }
                if class > self.opts.capacity_bytes {
                    self.stats.write_failures.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                evicted.extend(self.evict_to(class)?);
                let mut ix = self.lock_index();
                if ix.used + class > self.opts.capacity_bytes {
                    self.stats.write_failures.fetch_add(1, Ordering::Relaxed);
                    continue; // everything left is pinned by readers
                }
                // MAX_OBJECT keeps every class within u32 (checked above)
                let class32 = u32::try_from(class).expect("class <= MAX_OBJECT fits u32");
                let slot = ix.take_slot(class32);
                ix.used += class; // reserved; moved into the entry on success
                plan.push((i, class32, slot));
            }
        }
        let release = |plan: &[(usize, u32, u32)]| {
            let mut ix = self.lock_index();
            for &(_, class, slot) in plan {
                ix.used -= class as u64;
                ix.free.entry(class).or_default().push(slot);
            }
        };
        // 2. deletions of evicted objects are durable before their slots are rewritten
        if let Err(e) = self.append(
            &evicted
                .iter()
                .map(|k| Record::Del { key: k.clone() })
                .collect::<Vec<_>>(),
        ) {
            release(&plan);
            self.stats
                .write_failures
                .fetch_add(plan.len() as u64, Ordering::Relaxed);
            return Err(e);
        }
        // 3. make room on disk, then write every object in parallel
        let mut classes = HashMap::new();
        let mut failed = vec![false; plan.len()];
        for (j, &(_, class, slot)) in plan.iter().enumerate() {
            let c = match classes.get(&class) {
                Some(c) => Arc::clone(c),
                None => match self.class(class) {
                    Ok(c) => {
                        classes.insert(class, c.clone());
                        c
                    }
                    Err(_) => {
                        failed[j] = true;
                        continue;
                    }
                },
            };
            let end = (slot as u64 + 1) * class as u64;
            let mut alloc = c.allocated.lock().unwrap_or_else(|p| p.into_inner());
            if *alloc < end {
                // Grow in steps of at least 64 MiB so every batch does not pay a fallocate; fall back to the
                // exact size when the step does not fit (a nearly full disk).
                let target = end.max(
                    alloc
                        .saturating_add(64 << 20)
                        .min(end.saturating_add(1 << 30)),
                );
                let grown = crate::fault::check("fallocate")
                    .and_then(|()| fallocate(&c.buffered, *alloc, target - *alloc))
                    .map(|()| target)
                    .or_else(|_| {
                        crate::fault::check("fallocate")
                            .and_then(|()| fallocate(&c.buffered, *alloc, end - *alloc))
                            .map(|()| end)
                    });
                match grown {
                    Ok(n) => *alloc = n,
                    Err(_) => failed[j] = true,
                }
            }
        }
        let crcs: Vec<AtomicU64> = (0..plan.len()).map(|_| AtomicU64::new(u64::MAX)).collect();
        let failed_ref = &failed;
        self.parallel(plan.len(), |j| {
            if failed_ref[j] {
                return;
            }
            let (i, class, slot) = plan[j];
            let (key, ptr, len) = objs[i];
            // SAFETY: the caller guarantees [ptr, ptr+len) is readable for the whole call.
            let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) };
            let crc = crc32c::crc32c_append(crc32c::crc32c(bytes), key.as_bytes());
            let c = &classes[&class];
            let off = slot as u64 * class as u64;
            let res = match crate::fault::take("data_write") {
                // partial writes exist only here; everything else is handled as at any other point
                Some(crate::fault::Fault::Short(e)) => c
                    .buffered
                    .write_all_at(&bytes[..bytes.len() / 2], off)
                    .and(Err(std::io::Error::from_raw_os_error(e))),
                Some(crate::fault::Fault::Torn) => {
                    let mut torn = bytes.to_vec();
                    torn[bytes.len() / 2..].fill(0);
                    c.buffered.write_all_at(&torn, off)
                }
                other => crate::fault::apply(other).and_then(|()| write_object(c, bytes, off)),
            };
            if res.is_ok() {
                crcs[j].store(crc as u64, Ordering::Relaxed);
            }
        });
        // 4. data durable
        let mut synced: HashMap<u32, bool> = HashMap::new();
        for (&class, c) in &classes {
            let r = crate::fault::check("data_sync").and_then(|()| c.buffered.sync_data());
            synced.insert(class, r.is_ok());
        }
        // 5. records durable
        let mut recs = Vec::new();
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for (j, &(i, class, slot)) in plan.iter().enumerate() {
            let crc = crcs[j].load(Ordering::Relaxed);
            if crc == u64::MAX || !synced.get(&class).copied().unwrap_or(false) {
                bad.push(plan[j]);
                continue;
            }
            let (k, _, len) = objs[i];
            recs.push(Record::Put {
                key: k.to_owned(),
                class,
                slot,
                len,
                crc: crc as u32,
            });
            good.push((j, i, class, slot, len, crc as u32));
        }
        release(&bad);
        self.stats
            .write_failures
            .fetch_add(bad.len() as u64, Ordering::Relaxed);
        if let Err(_e) = self.append(&recs) {
            release(&good.iter().map(|g| (g.1, g.2, g.3)).collect::<Vec<_>>());
            self.stats
                .write_failures
                .fetch_add(good.len() as u64, Ordering::Relaxed);
            return Ok(ok);
        }
        let mut ix = self.lock_index();
        let mut bytes = 0;
        for (_, i, class, slot, len, crc) in good {
            ix.used -= class as u64; // the reservation becomes the entry's
            ix.insert(
                objs[i].0.to_owned(),
                Entry {
                    class,
                    slot,
                    len,
                    crc,
                    tick: 0,
                    pins: 0,
                },
            );
            ok[i] = true;
            bytes += len;
        }
        drop(ix);
        self.stats
            .puts
            .fetch_add(ok.iter().filter(|&&b| b).count() as u64, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        self.stats
            .put_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(ok)
    }

    /// Reads objects `(key, ptr, len)` into memory; returns per object whether it was found with exactly
    /// that length and its checksum verified. A corrupt object is dropped from the store.
    ///
    /// # Safety
    /// Each `[ptr, ptr+len)` must be writable memory, not read or written by anyone else during the call.
    pub unsafe fn get(&self, objs: &[(&str, usize, u64)]) -> Result<Vec<bool>> {
        for (k, _, _) in objs {
            Self::check_key(k)?;
        }
        let t0 = std::time::Instant::now();
        let mut work: Vec<(usize, Entry)> = Vec::new();
        {
            let mut ix = self.lock_index();
            for (i, (k, _, len)) in objs.iter().enumerate() {
                let found = ix.map.get(*k).cloned();
                match found {
                    Some(e) if e.len == *len => {
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
        let results: Vec<AtomicU64> = (0..work.len()).map(|_| AtomicU64::new(0)).collect(); // 1 ok, 2 corrupt, 3 io
        self.parallel(work.len(), |j| {
            let (i, ref e) = work[j];
            let (key, ptr, len) = objs[i];
            let Some(c) = classes.get(&e.class) else {
                results[j].store(3, Ordering::Relaxed);
                return;
            };
            // SAFETY: the caller guarantees [ptr, ptr+len) is writable and exclusively ours for the call.
            let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len as usize) };
            let off = e.slot as u64 * e.class as u64;
            let r = match crate::fault::check("data_read").and_then(|()| read_object(c, buf, off)) {
                Err(_) => 3,
                Ok(()) if crc32c::crc32c_append(crc32c::crc32c(buf), key.as_bytes()) == e.crc => 1,
                Ok(()) => 2,
            };
            results[j].store(r, Ordering::Relaxed);
        });
        let mut ok = vec![false; objs.len()];
        let mut corrupt = Vec::new();
        let mut bytes = 0;
        {
            let mut ix = self.lock_index();
            for (j, (i, e)) in work.iter().enumerate() {
                let key = objs[*i].0;
                ix.unpin(key, e.class, e.slot);
                match results[j].load(Ordering::Relaxed) {
                    1 => {
                        ok[*i] = true;
                        bytes += e.len;
                    }
                    2 => {
                        // drop it only if it is still the object we read
                        if ix.map.get(key).is_some_and(|x| {
                            x.slot == e.slot && x.class == e.class && x.crc == e.crc
                        }) {
                            ix.remove(key);
                            corrupt.push(Record::Del {
                                key: key.to_owned(),
                            });
                        }
                        self.stats.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        self.stats.read_failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        let _ = self.append(&corrupt);
        self.stats
            .hits
            .fetch_add(ok.iter().filter(|&&b| b).count() as u64, Ordering::Relaxed);
        self.stats.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.stats
            .get_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(ok)
    }

    /// Whether each key is stored.
    pub fn exists(&self, keys: &[&str]) -> Vec<bool> {
        let ix = self.lock_index();
        keys.iter().map(|k| ix.map.contains_key(*k)).collect()
    }

    /// Length of the stored object `key`, if any.
    pub fn len_of(&self, key: &str) -> Option<u64> {
        self.lock_index().map.get(key).map(|e| e.len)
    }

    /// Deletes keys; returns how many existed. Durable when it returns.
    pub fn delete(&self, keys: &[&str]) -> Result<usize> {
        let mut recs = Vec::new();
        {
            let mut ix = self.lock_index();
            for k in keys {
                if ix.remove(k).is_some() {
                    recs.push(Record::Del {
                        key: (*k).to_owned(),
                    });
                }
            }
        }
        self.append(&recs)?;
        Ok(recs.len())
    }

    /// Deletes every object of this namespace.
    pub fn clear(&self) -> Result<usize> {
        let keys = self.keys();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.delete(&refs)
    }

    /// Re-reads every object and checks its checksum; returns `(checked, corrupt keys)`; with `drop`,
    /// corrupt objects are deleted.
    pub fn verify(&self, drop: bool) -> Result<(usize, Vec<String>)> {
        let entries: Vec<(String, Entry)> = self
            .lock_index()
            .map
            .iter()
            .map(|(k, e)| (k.clone(), e.clone()))
            .collect();
        let mut bad = Vec::new();
        for (k, e) in &entries {
            let c = self.class(e.class)?;
            let mut buf = vec![0u8; e.len as usize];
            let ok = c
                .buffered
                .read_exact_at(&mut buf, e.slot as u64 * e.class as u64)
                .is_ok()
                && crc32c::crc32c_append(crc32c::crc32c(&buf), k.as_bytes()) == e.crc;
            if !ok {
                bad.push(k.clone());
            }
        }
        if drop {
            let refs: Vec<&str> = bad.iter().map(String::as_str).collect();
            self.delete(&refs)?;
        }
        Ok((entries.len(), bad))
    }

    /// Data files of this namespace (for tests and inspection).
    pub fn data_files(&self) -> Vec<PathBuf> {
        self.classes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|c| c.path.clone())
            .collect()
    }
}

/// Rewrites the journal as one `put` per live entry; returns the new journal opened for appending.
fn compact(dir: &Path, jpath: &Path, index: &Index) -> Result<File> {
    let mut buf = Vec::new();
    // oldest first, so the LRU order survives a reopen
    for key in index.lru.values() {
        let e = &index.map[key];
        Record::Put {
            key: key.clone(),
            class: e.class,
            slot: e.slot,
            len: e.len,
            crc: e.crc,
        }
        .encode(&mut buf);
    }
    let tmp = dir.join("journal.compact");
    let r = (|| -> std::io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&buf)?;
        f.sync_all()?;
        std::fs::rename(&tmp, jpath)?;
        File::open(dir)?.sync_all()
    })();
    r.map_err(|e| io_err("compacting journal.log", e))?;
    OpenOptions::new()
        .read(true)
        .append(true)
        .open(jpath)
        .map_err(|e| io_err("reopening journal.log", e))
}

fn fallocate(f: &File, off: u64, len: u64) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: fallocate on a file descriptor we own, with in-range non-negative offsets.
    let rc = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(f),
            0,
            off as i64,
            len as i64,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        // File systems without fallocate: extend the file instead (space is then claimed on write).
        let cur = f.metadata()?.len();
        if cur < off + len {
            f.set_len(off + len)?;
        }
        return Ok(());
    }
    Err(e)
}

fn aligned(ptr: usize, len: usize, off: u64) -> bool {
    ptr % ALIGN as usize == 0 && len % ALIGN as usize == 0 && off % ALIGN == 0
}

fn write_object(c: &Class, bytes: &[u8], off: u64) -> std::io::Result<()> {
    match &c.direct {
        Some(d) if aligned(bytes.as_ptr() as usize, bytes.len(), off) => d.write_all_at(bytes, off),
        _ => c.buffered.write_all_at(bytes, off),
    }
}

fn read_object(c: &Class, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    match &c.direct {
        Some(d) if aligned(buf.as_ptr() as usize, buf.len(), off) => d.read_exact_at(buf, off),
        _ => c.buffered.read_exact_at(buf, off),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Mutex as StdMutex;

    /// Store tests share the process-wide fault table: run them one at a time.
    static SERIAL: StdMutex<()> = StdMutex::new(());

    fn tmp() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvtier-store-{}-{}",
            std::process::id(),
            rand_u64()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn rand_u64() -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64,
        );
        h.finish()
    }

    fn opts(cap: u64) -> StoreOptions {
        StoreOptions {
            capacity_bytes: cap,
            io_threads: 4,
            direct: None,
        }
    }

    /// An aligned buffer holding `n` objects of `len` bytes with distinct contents.
    fn payload(n: usize, len: usize, seed: u8) -> crate::buffer::HostRegion {
        let r = crate::buffer::HostRegion::new(
            n * len.div_ceil(4096) * 4096 + 4096,
            &Default::default(),
        )
        .unwrap();
        // SAFETY: the region owns its bytes.
        let s = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), r.len()) };
        for (i, b) in s.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8;
        }
        r
    }

    fn put1(s: &PageStore, key: &str, ptr: usize, len: u64) -> bool {
        // SAFETY: callers pass memory of a live region of at least len bytes.
        unsafe { s.put(&[(key, ptr, len)]) }.unwrap()[0]
    }

    fn get1(s: &PageStore, key: &str, ptr: usize, len: u64) -> bool {
        // SAFETY: as put1.
        unsafe { s.get(&[(key, ptr, len)]) }.unwrap()[0]
    }

    #[test]
    fn put_get_reopen_bit_exact() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let src = payload(3, 8192, 1);
        let dst = payload(3, 8192, 2);
        let base = src.as_ptr() as usize;
        {
            let s = PageStore::open(&root, "model|geo", opts(1 << 30)).unwrap();
            // SAFETY: three 8192-byte objects inside `src`.
            let ok = unsafe {
                s.put(&[
                    ("a", base, 8192),
                    ("b", base + 8192, 5000),
                    ("c", base + 16384, 8192),
                ])
            }
            .unwrap();
            assert_eq!(ok, vec![true, true, true]);
            assert_eq!(s.exists(&["a", "b", "zz"]), vec![true, true, false]);
        }
        let s = PageStore::open(&root, "model|geo", opts(1 << 30)).unwrap();
        let d = dst.as_ptr() as usize;
        assert!(get1(&s, "b", d, 5000));
        // SAFETY: both regions hold at least 5000 bytes at these offsets.
        unsafe {
            assert_eq!(
                std::slice::from_raw_parts(d as *const u8, 5000),
                std::slice::from_raw_parts((base + 8192) as *const u8, 5000)
            )
        };
        assert!(!get1(&s, "b", d, 4096), "a length mismatch is a miss");
        assert!(!get1(&s, "nope", d, 8192));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn second_writer_is_refused_and_namespaces_are_isolated() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let a = PageStore::open(&root, "ns-a", opts(1 << 30)).unwrap();
        let e = PageStore::open(&root, "ns-a", opts(1 << 30))
            .err()
            .expect("second open must fail");
        assert!(e.to_string().contains("already open"), "{e}");
        let b = PageStore::open(&root, "ns-b", opts(1 << 30)).unwrap();
        let src = payload(1, 4096, 3);
        assert!(put1(&a, "k", src.as_ptr() as usize, 4096));
        assert_eq!(b.exists(&["k"]), vec![false]);
        let mode = std::fs::metadata(a.dir()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn capacity_evicts_lru_and_keys_are_not_paths() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let s = PageStore::open(&root, "ns", opts(3 * 4096)).unwrap();
        let src = payload(4, 4096, 4);
        let p = src.as_ptr() as usize;
        for (i, k) in ["../../etc/x", "/abs", "k3"].iter().enumerate() {
            assert!(put1(&s, k, p + i * 4096, 4096));
        }
        assert!(get1(&s, "../../etc/x", p + 3 * 4096, 4096)); // touch: now most recent
        assert!(put1(&s, "k4", p + 3 * 4096, 4096));
        assert_eq!(
            s.exists(&["../../etc/x", "/abs", "k3", "k4"]),
            vec![true, false, true, true]
        );
        assert_eq!(s.stats.evictions.load(Ordering::Relaxed), 1);
        assert!(s.usage().1 <= 3 * 4096);
        // nothing was created outside the namespace directory
        let names: Vec<_> = std::fs::read_dir(s.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            names.iter().all(|n| !n.to_string_lossy().contains("etc")),
            "{names:?}"
        );
        assert!(!root.join("etc").exists() && !Path::new("/abs").exists());
        // an object larger than the capacity fails alone
        let big = payload(1, 16384, 5);
        assert!(!put1(&s, "big", big.as_ptr() as usize, 16384));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn corruption_is_a_counted_miss_and_the_object_is_dropped() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let src = payload(2, 4096, 6);
        let p = src.as_ptr() as usize;
        let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
        assert!(put1(&s, "x", p, 4096) && put1(&s, "y", p + 4096, 4096));
        let f = s.data_files().pop().unwrap();
        let data = OpenOptions::new().write(true).open(&f).unwrap();
        data.write_all_at(&[0xFF; 7], 100).unwrap(); // slot 0 = "x"
        data.sync_all().unwrap();
        let dst = payload(1, 4096, 0);
        assert!(!get1(&s, "x", dst.as_ptr() as usize, 4096));
        assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1);
        assert_eq!(s.exists(&["x", "y"]), vec![false, true]);
        assert!(get1(&s, "y", dst.as_ptr() as usize, 4096));
        let (_, bad) = s.verify(false).unwrap();
        assert!(bad.is_empty());
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn injected_io_failures_fail_only_those_pages_and_lose_nothing() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        for point in [
            "fallocate",
            "data_write",
            "data_sync",
            "journal_write",
            "journal_sync",
        ] {
            let root = tmp();
            let src = payload(6, 4096, 7);
            let p = src.as_ptr() as usize;
            let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
            assert!(put1(&s, "before", p, 4096));
            // 8 KiB objects: a new size class, so the batch must allocate space (the fallocate point)
            crate::fault::set(
                point,
                0,
                if point == "fallocate" { 2 } else { 1 },
                crate::fault::Fault::Error(libc::ENOSPC),
            );
            // SAFETY: objects inside `src` (6 pages of 4096 bytes).
            let r = unsafe { s.put(&[("f1", p + 4096, 8192), ("f2", p + 8192, 8192)]) };
            crate::fault::clear();
            let ok = r.unwrap_or_else(|_| vec![false, false]);
            assert_eq!(
                s.exists(&["f1", "f2"]),
                ok,
                "{point}: reported result and index disagree"
            );
            if point == "data_write" || point == "fallocate" {
                assert_eq!(
                    ok.iter().filter(|b| !**b).count(),
                    1,
                    "{point}: only the object hit fails: {ok:?}"
                );
            } else {
                assert!(
                    ok.iter().all(|b| !b),
                    "{point}: a batch-wide failure must fail every object: {ok:?}"
                );
            }
            // the store keeps serving and nothing stored before is lost
            assert!(put1(&s, "after", p + 12288, 4096), "{point}");
            drop(s);
            let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
            let dst = payload(1, 4096, 0);
            for (k, off) in [("before", 0), ("after", 12288)] {
                assert!(
                    get1(&s, k, dst.as_ptr() as usize, 4096),
                    "{point}: {k} lost"
                );
                // SAFETY: both 4096-byte ranges are inside live regions.
                unsafe {
                    assert_eq!(
                        std::slice::from_raw_parts(dst.as_ptr(), 4096),
                        std::slice::from_raw_parts((p + off) as *const u8, 4096)
                    )
                };
            }
            for (k, stored) in ["f1", "f2"].iter().zip(&ok) {
                assert_eq!(s.exists(&[k])[0], *stored, "{point}: {k} after reopen");
            }
            std::fs::remove_dir_all(root).unwrap();
        }
    }

    #[test]
    fn object_size_limit_keeps_classes_within_the_journal_field() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        assert!(MAX_OBJECT.div_ceil(ALIGN) * ALIGN <= u64::from(u32::MAX));
        let root = tmp();
        let src = payload(1, 4096, 3);
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        for len in [0, MAX_OBJECT + 1, 1 << 32, u64::MAX] {
            // SAFETY: refused before any byte is read (the length is checked first).
            let r = unsafe { s.put(&[("big", src.as_ptr() as usize, len)]) };
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. })),
                "{len}: {r:?}"
            );
        }
        assert!(!s.exists(&["big"])[0]);
        assert_eq!(s.usage().1, 0, "nothing reserved");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn short_torn_and_slow_object_writes() {
        use crate::fault::Fault;
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let src = payload(4, 4096, 11);
        let p = src.as_ptr() as usize;
        let dst = payload(1, 4096, 0);
        let same = |off: usize| {
            // SAFETY: both 4096-byte ranges are inside live regions (`dst` and `src`).
            unsafe {
                std::slice::from_raw_parts(dst.as_ptr(), 4096)
                    == std::slice::from_raw_parts((p + off) as *const u8, 4096)
            }
        };
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        // a short write fails its object only; the half written never becomes reachable
        crate::fault::set("data_write", 0, 1, Fault::Short(libc::EIO));
        // SAFETY: objects inside `src` (4 pages of 4096 bytes).
        let ok = unsafe { s.put(&[("s1", p, 4096), ("s2", p + 4096, 4096)]) }.unwrap();
        assert_eq!(crate::fault::hits("data_write"), 1);
        crate::fault::clear();
        assert_eq!(ok.iter().filter(|b| !**b).count(), 1, "{ok:?}");
        assert_eq!(s.exists(&["s1", "s2"]), ok);
        assert_eq!(s.stats.write_failures.load(Ordering::Relaxed), 1);
        // a torn write is acknowledged (the disk lied); the checksum turns it into a counted miss on read
        crate::fault::set("data_write", 0, 1, Fault::Torn);
        assert!(put1(&s, "t", p + 8192, 4096));
        crate::fault::clear();
        assert!(!get1(&s, "t", dst.as_ptr() as usize, 4096));
        assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1);
        assert!(!s.exists(&["t"])[0], "a corrupt object is dropped");
        // a slow disk delays but does not fail
        crate::fault::set(
            "data_write",
            0,
            1,
            Fault::Delay(std::time::Duration::from_millis(200)),
        );
        let t0 = std::time::Instant::now();
        assert!(put1(&s, "slow", p + 12288, 4096));
        assert!(t0.elapsed() >= std::time::Duration::from_millis(200));
        crate::fault::clear();
        drop(s);
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        for (k, off, stored) in [("s1", 0, ok[0]), ("s2", 4096, ok[1]), ("slow", 12288, true)] {
            assert_eq!(get1(&s, k, dst.as_ptr() as usize, 4096), stored, "{k}");
            if stored {
                assert!(same(off), "{k}: wrong bytes");
            }
        }
        assert!(!s.exists(&["t"])[0]);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn torn_journal_tail_is_cut() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let src = payload(2, 4096, 8);
        let p = src.as_ptr() as usize;
        let dir;
        {
            let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
            assert!(put1(&s, "a", p, 4096) && put1(&s, "b", p + 4096, 4096));
            dir = s.dir().to_owned();
        }
        let j = dir.join("journal.log");
        let len = std::fs::metadata(&j).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&j)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
        let s = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
        assert_eq!(s.exists(&["a", "b"]), vec![true, false]);
        assert!(s.recovered_tail() > 0);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn journal_is_compacted_at_open_and_nothing_is_lost() {
        let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let root = tmp();
        let src = payload(2, 4096, 10);
        let p = src.as_ptr() as usize;
        let jlen;
        {
            let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
            // churn: 16,000 put+delete pairs (in batches of 1,000) leave two live objects behind a ~1.4 MB journal
            for b in 0..16 {
                let keys: Vec<String> = (0..1000)
                    .map(|i| format!("churn-{}", b * 1000 + i))
                    .collect();
                let objs: Vec<(&str, usize, u64)> =
                    keys.iter().map(|k| (k.as_str(), p, 4096)).collect();
                // SAFETY: every object is the first 4096 bytes of `src`.
                assert!(unsafe { s.put(&objs) }.unwrap().iter().all(|&x| x));
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                s.delete(&refs).unwrap();
            }
            assert!(put1(&s, "keep-a", p, 4096) && put1(&s, "keep-b", p + 4096, 4096));
            jlen = std::fs::metadata(s.dir().join("journal.log"))
                .unwrap()
                .len();
            assert!(jlen > 1 << 20);
        }
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        let after = std::fs::metadata(s.dir().join("journal.log"))
            .unwrap()
            .len();
        assert!(after < 1024, "journal not compacted: {jlen} -> {after}");
        let dst = payload(1, 4096, 0);
        for (k, off) in [("keep-a", 0), ("keep-b", 4096)] {
            assert!(get1(&s, k, dst.as_ptr() as usize, 4096));
            // SAFETY: 4096 bytes inside live regions.
            unsafe {
                assert_eq!(
                    std::slice::from_raw_parts(dst.as_ptr(), 4096),
                    std::slice::from_raw_parts((p + off) as *const u8, 4096)
                )
            };
        }
        assert_eq!(s.exists(&["churn-5"]), vec![false]);
        // appends after compaction land in the new journal and survive another reopen
        assert!(put1(&s, "new", p, 4096));
        drop(s);
        let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        assert_eq!(
            s.exists(&["keep-a", "keep-b", "new"]),
            vec![true, true, true]
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Put(u8, u8),
        Get(u8),
        Del(u8),
        Reopen,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..12, 0u8..4).prop_map(|(k, v)| Op::Put(k, v)),
            3 => (0u8..12).prop_map(Op::Get),
            1 => (0u8..12).prop_map(Op::Del),
            1 => Just(Op::Reopen),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]
        #[test]
        fn behaves_like_a_bounded_map(ops in proptest::collection::vec(op(), 1..40)) {
            let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
            let root = tmp();
            // four distinct 8 KiB payloads; capacity of 6 objects forces eviction
            let src = payload(4, 8192, 9);
            let dst = payload(1, 8192, 0);
            let cap = 6 * 8192;
            let mut s = Some(PageStore::open(&root, "ns", opts(cap)).unwrap());
            let mut model: HashMap<u8, u8> = HashMap::new();
            for o in ops {
                let st = s.as_ref().unwrap();
                match o {
                    Op::Put(k, v) => {
                        let key = format!("k{k}");
                        let ok = put1(st, &key, src.as_ptr() as usize + v as usize * 8192, 8192);
                        prop_assert!(ok);
                        model.entry(k).or_insert(v); // existing keys keep their first value
                    }
                    Op::Get(k) => {
                        let got = get1(st, &format!("k{k}"), dst.as_ptr() as usize, 8192);
                        if got {
                            let v = *model.get(&k).expect("store returned a key the model never had");
                            // SAFETY: 8192 bytes inside live regions.
                            let same = unsafe { std::slice::from_raw_parts(dst.as_ptr(), 8192) == std::slice::from_raw_parts(src.as_ptr().add(v as usize * 8192), 8192) };
                            prop_assert!(same, "wrong bytes for k{}", k);
                        }
                    }
                    Op::Del(k) => {
                        st.delete(&[&format!("k{k}")]).unwrap();
                        model.remove(&k);
                    }
                    Op::Reopen => {
                        drop(s.take()); // release the LOCK before reopening
                        s = Some(PageStore::open(&root, "ns", opts(cap)).unwrap());
                    }
                }
                let st = s.as_ref().unwrap();
                // the store holds a subset of the model (eviction may drop entries) and stays under capacity
                for k in st.keys() {
                    let id: u8 = k[1..].parse().unwrap();
                    prop_assert!(model.contains_key(&id));
                }
                prop_assert!(st.usage().1 <= cap);
                // evicted keys leave the model too (they are misses from now on)
                model.retain(|k, _| st.exists(&[&format!("k{k}")])[0]);
            }
            drop(s);
            std::fs::remove_dir_all(root).unwrap();
        }
    }
}

//! The page store: durable, checksummed, capacity-bounded storage of KV page objects on a local disk or a
//! shared file system, with O_DIRECT IO straight from and into the caller's (pinned, aligned) memory.
//!
//! The design — file formats, the order of every step of put, get, delete, eviction, compaction and open,
//! and why each crash or error point is safe — is docs/STORE.md. The modules follow it,
//! grouped by component (every module of the store is named here):
//!
//! - [`journal`]: the record format ([`journal::layout`]: where each field lies) and the resynchronising
//!   parser;
//! - `index`: keys, LRU order, slot states and occupancy (`index::entry`: one stored object;
//!   `index::fasthash`: the maps' hasher);
//! - `log`, the journal as the store keeps it: `log::commit` (the commit lock, appends, the prepaid delete
//!   reserve), `log::compact` (compaction in steps between commits), `log::evict` (eviction to the
//!   space's limits, before a put and after open), `log::recovery` (replay at open, with
//!   `log::replay_keys`), `log::follow` (a read-only store following its writer), `log::locks` (the log's
//!   locks and their order);
//! - `space`, where objects live and the room they take: `space::files` (data files, blocks, hole
//!   punching, the O_DIRECT probe), `space::disk` (the file-system steps every store file shares),
//!   `space::capacity` (the limits occupancy is kept within), `space::budget` (the store directory's
//!   budget, shared by its namespaces). The log consults the space (`limit`, `fits`, `settle`,
//!   `punch_slots`); the one edge back is the space reading the index through `log::locks::Log` (its
//!   occupancy to publish, slots punched), a lock of the log's state, not a log step;
//! - `io`, object bytes between memory and disk: `io::write` (put; `io::allocate` its blocks, `io::encode`
//!   its coding), `io::read` (get and verify; `io::read_coded` for coded objects), `io::seal_io` (sealed
//!   and coded objects' buffers), `io::pages` (page-level batches over a bound host pool; `io::staging`
//!   its staging pages), `io::memory` (host memory registered for IO);
//! - [`stats`]: counters, phases and the open report (`stats::file`: the counters on disk, `STATS`);
//! - `worker`: the writer's background thread (compaction steps, closing replaced journals, `STATS`);
//! - `namespace`: the namespace directory, its writer's `LOCK` and `NAMESPACE` file; [`format`](mod@format): the
//!   `FORMAT` version files; [`lifecycle`]: a store directory's namespaces as a whole;
//! - `open`: opening a namespace (options, the O_DIRECT probe, the journal read and its torn tail);
//! - `erase`: erasing one tenant from a namespace.

mod erase;
pub mod format;
mod index;
mod io;
pub mod journal;
pub mod lifecycle;
mod log;
mod namespace;
mod open;
mod space;
pub mod stats;
mod worker;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::seal::Keyring;
use space::files::ClassFile;

pub use io::pages::{PageBatch, PageLayout, Pages};
pub use io::read::VerifyReport;
pub use namespace::namespace_dir;
pub use stats::{OpenReport, Stats};

const ALIGN: u64 = 4096;
/// Largest object: its size class (the length rounded up to 4 KiB) must fit the journal's 32-bit field.
pub const MAX_OBJECT: u64 = (1 << 32) - ALIGN;

/// Options of [`PageStore::open`].
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Hard limit on the bytes the store occupies on disk: data blocks plus the journal (docs/STORE.md,
    /// "Capacity, exactly").
    pub capacity_bytes: u64,
    /// The budget of the whole store directory, shared by every namespace in it and every process writing
    /// one (docs/STORE.md, "One budget for a store directory"): `Some(bytes)` sets it (0 removes it),
    /// `None` keeps the one the directory has. A writable open honours the directory's budget either way.
    pub budget_bytes: Option<u64>,
    /// Threads doing IO in parallel for one batch (the queue depth).
    pub io_threads: usize,
    /// `Some(false)` disables O_DIRECT; `None` probes it; `Some(true)` requires it.
    pub direct: Option<bool>,
    /// Seal every object at rest with its tenant's key from this keyring (`crate::seal`); `None`: clear.
    /// A sealed store serves only sealed objects and a clear one only clear objects.
    pub keyring: Option<Arc<Keyring>>,
    /// Store objects compressed with this codec when that saves at least a block (`crate::codec`;
    /// docs/STORE.md, "Compressed objects"); `None`: as given. Whatever it is, coded objects already
    /// stored are read (a store reads both).
    pub codec: Option<crate::codec::Elem>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            capacity_bytes: 64 << 30,
            budget_bytes: None,
            io_threads: 16,
            direct: None,
            keyring: None,
            codec: None,
        }
    }
}

/// One open namespace of a page store. Thread-safe; every method takes `&self` (most are [`Shared`]'s,
/// reached through `Deref`).
pub struct PageStore {
    inner: Arc<Shared>,
    report: OpenReport,
}

/// The store itself, shared by its handle ([`PageStore`]) and the writer's background thread, which runs
/// compaction steps off the put path (`worker`): it holds the store only while a job runs, and the handle's
/// drop joins it first.
pub struct Shared {
    /// This store, for the jobs it hands to its background thread.
    me: std::sync::Weak<Shared>,
    /// A compaction step is queued for the background thread and has not started yet.
    step_queued: AtomicBool,
    dir: PathBuf,
    namespace: String,
    opts: StoreOptions,
    direct: bool,
    direct_note: Option<String>,
    read_only: bool,
    /// Read-only open: a writer held `LOCK` when this store was opened.
    live_writer: bool,
    _lock: Option<std::fs::File>,
    /// The running compaction or a follower's place, the journal (the commit lock) and the index, behind
    /// their locks, which it takes in their one order (`log::locks`).
    log: log::locks::Log,
    classes: Mutex<HashMap<u32, Arc<ClassFile>>>,
    /// Serializes block allocation and the file-length bookkeeping around it.
    alloc_lock: Mutex<()>,
    punch_ok: AtomicBool,
    /// Aligned buffers sealed objects are written from, reused across objects and batches.
    scratch: io::seal_io::ScratchPool,
    poisoned: AtomicBool,
    pages: io::pages::Bound,
    /// Host memory registered for IO (see `io::memory`).
    memory: io::memory::Memory,
    /// This namespace's share of the root's budget (writable stores).
    share: Option<space::budget::Share>,
    /// When the counters were last written to `STATS` (see `stats::file`).
    stats_file: stats::file::StatsFile,
    /// Work taken off the put path: closing replaced journals, rewriting `STATS` (see `worker`).
    worker: worker::Worker,
    /// Tenants erased through this store (stored tags): their puts fail until allowed again (see `erase`).
    erased: erase::Erased,
    /// Counters.
    pub stats: Stats,
}

impl std::ops::Deref for PageStore {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.inner
    }
}

fn io_err(what: impl Into<String>, e: std::io::Error) -> Error {
    Error::Os {
        what: what.into(),
        source: e,
    }
}

impl PageStore {
    /// Opens (creating if needed) `namespace` under `root` for reading and writing, replaying its journal.
    pub fn open(root: &Path, namespace: &str, opts: StoreOptions) -> Result<Self> {
        Self::open_impl(root, namespace, opts, open::Mode::Writable)
    }

    /// [`open`](Self::open) for a maintenance command (an erase, a repair) rather than the namespace's
    /// engine: the counters and the capacity the engine left in `STATS` are loaded and kept, this store's
    /// own counters added to them (what it really changed: objects removed, compactions), and
    /// `maintained_unix_ms` records when (docs/STORE.md, "Counters on disk"). `opts.capacity_bytes` limits
    /// this open only.
    pub fn open_maintenance(root: &Path, namespace: &str, opts: StoreOptions) -> Result<Self> {
        Self::open_impl(root, namespace, opts, open::Mode::Maintenance)
    }

    /// Opens an existing namespace without writing: nothing is created, locked, written or truncated, so it
    /// works on a store another process has open (whose new records it follows: see `log::follow`) and on a
    /// directory without write permission.
    pub fn open_read_only(root: &Path, namespace: &str) -> Result<Self> {
        Self::open_read_only_sealed(root, namespace, None)
    }

    /// [`open_read_only`](Self::open_read_only) for a sealed namespace: objects are opened with `keyring`.
    pub fn open_read_only_sealed(
        root: &Path,
        namespace: &str,
        keyring: Option<Arc<Keyring>>,
    ) -> Result<Self> {
        let opts = StoreOptions {
            capacity_bytes: u64::MAX,
            budget_bytes: None,
            io_threads: 4,
            direct: Some(false),
            keyring,
            codec: None,
        };
        Self::open_impl(root, namespace, opts, open::Mode::ReadOnly)
    }

    /// What opening the store found on disk.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }
    /// Bytes of a torn journal tail found at open (cut unless read-only).
    pub fn recovered_tail(&self) -> u64 {
        self.report.torn_tail
    }
}

impl Shared {
    /// The namespace directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The codec new objects are stored with (`StoreOptions::codec`).
    pub fn codec(&self) -> Option<crate::codec::Elem> {
        self.opts.codec
    }
    /// The namespace string.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    /// True when data IO uses O_DIRECT.
    pub fn direct(&self) -> bool {
        self.direct
    }
    /// Why O_DIRECT is not used (or was kept without a successful probe), if so.
    pub fn direct_note(&self) -> Option<&str> {
        self.direct_note.as_deref()
    }
    /// Whether this store was opened read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }
    /// Read-only open: whether a writer held the namespace when it was opened (results are a snapshot).
    pub fn live_writer(&self) -> bool {
        self.live_writer
    }
    /// The capacity limit.
    pub fn capacity(&self) -> u64 {
        self.opts.capacity_bytes
    }
    /// The root's budget (`None`: none, or a read-only store) and this namespace's claim on it.
    pub fn budget(&self) -> Option<(u64, u64)> {
        let s = self.share.as_ref()?;
        Some((s.budget(), s.claimed())).filter(|b| b.0 > 0)
    }
    /// Whether a failed journal append could not be undone: mutations fail until the store is reopened.
    pub fn poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Relaxed)
    }
    /// `(objects, bytes of slots in use)`.
    pub fn usage(&self) -> (usize, u64) {
        let ix = self.log.index();
        (ix.servable_count(), ix.used)
    }
    /// What the servable objects hold and take: `(objects stored coded, bytes stored, bytes they decode
    /// to)` (an object stored as given counts its length in both); the ratio of the last two is what the
    /// codec gives the store's budget.
    pub fn content(&self) -> (usize, u64, u64) {
        let ix = self.log.index();
        debug_assert_eq!(
            ix.content,
            ix.map
                .values()
                .filter(|e| e.servable())
                .fold((0, 0, 0), |(n, s, d), e| {
                    (
                        n + usize::from(e.coded.is_some()),
                        s + e.len,
                        d + e.decoded_len(),
                    )
                })
        );
        ix.content
    }
    /// `(data bytes held, journal bytes held)`: the occupancy the capacity limit applies to.
    pub fn occupancy(&self) -> (u64, u64) {
        let ix = self.log.index();
        (ix.data_alloc, ix.j_alloc)
    }
    /// Bytes of disk blocks the store's files occupy now, as the file system reports them (`st_blocks`).
    pub fn disk_blocks(&self) -> u64 {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        rd.filter_map(|e| e.ok())
            .filter_map(|e| std::fs::File::open(e.path()).ok())
            .map(|f| space::files::allocated_bytes(&f))
            .sum()
    }
    /// All servable keys.
    pub fn keys(&self) -> Vec<String> {
        self.refresh_for(None);
        let ix = self.log.index();
        ix.map
            .iter()
            .filter(|(_, e)| e.servable())
            .map(|(k, _)| k.to_string())
            .collect()
    }

    fn class(&self, class: u32) -> Result<Arc<ClassFile>> {
        let mut cs = self.classes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cs.get(&class) {
            return Ok(c.clone());
        }
        let c = Arc::new(
            ClassFile::open(&self.dir, class, self.direct, !self.read_only)
                .map_err(|e| io_err(format!("opening class-{class}.dat"), e))?,
        );
        cs.insert(class, c.clone());
        Ok(c)
    }

    /// Runs `f(i)` for `i in 0..n` on up to `io_threads` threads: the caller's and helpers. A helper the
    /// OS refuses (a thread limit) is not an error: the threads that exist do its share.
    fn parallel<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        let threads = self.opts.io_threads.min(n);
        let next = AtomicUsize::new(0);
        let work = || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            f(i);
        };
        if threads <= 1 {
            return work();
        }
        std::thread::scope(|s| {
            for _ in 1..threads {
                if std::thread::Builder::new().spawn_scoped(s, work).is_err() {
                    break;
                }
            }
            work();
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

    /// [`PageStore::check_key`] for a key about to be written into the journal (put, delete). A key is
    /// written as it is: without control characters no key can hold a whole journal record (every
    /// record's kind byte is 1 to 5), so the parser's resynchronisation after a torn or damaged record can
    /// never find one inside a key and replay it (docs/STORE.md, "No record inside a key"). Reads take any
    /// key (one an older version stored stays readable).
    fn check_journal_key(key: &str) -> Result<()> {
        Self::check_key(key)?;
        if let Some(c) = key.chars().find(|c| c.is_ascii_control()) {
            return Err(Error::arg(
                "keys",
                format!(
                    "a key must not contain control characters, got {:?} in {key:?}",
                    c
                ),
            ));
        }
        Ok(())
    }

    /// Data files of this namespace opened so far (for tests and inspection).
    pub fn data_files(&self) -> Vec<PathBuf> {
        self.classes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|c| c.path.clone())
            .collect()
    }
}

//! One disk budget for a whole store directory: the root's `BUDGET` file, a table shared (`mmap`,
//! `MAP_SHARED`) by every process writing a namespace of the root. Its header holds the budget; each
//! namespace has a slot holding the occupancy its writer has *claimed*: before the namespace grows, its writer
//! stores the new total in its slot and then reads every other slot, in sequentially consistent order, so of
//! two writers claiming at once the later one sees the earlier one's claim (docs/STORE.md, "One budget for a
//! store directory").
//!
//! Layout (little-endian, 69,632 bytes): header `magic u64 "KVTBUDG1" | version u32 | slots u32 | budget
//! u64 (0: none) | high u32` (slots in use are below `high`), padded to 4096; then `SLOTS` slots of 64
//! bytes: `name [u8; 32]` (the namespace directory, NUL-padded; empty: free) `| claimed u64 | pid u32 |
//! pad u32 | waiting u64` (when a claim below its fair share last failed, Unix ms).
//! Names and `high` change only under `flock(LOCK_EX)` of the file; `claimed`, `pid` and `budget` are
//! atomics.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

use crate::error::{Error, Result};
use crate::store::io_err;

mod share;
pub(in crate::store) use share::Share;

/// The table's file name in the store root.
pub const BUDGET_FILE: &str = "BUDGET";
const MAGIC: u64 = u64::from_le_bytes(*b"KVTBUDG1");
const VERSION: u32 = 1;
/// Namespaces one root can hold (a slot each).
pub const SLOTS: usize = 1024;
const HEADER: usize = 4096;
const SLOT: usize = 64;
const NAME: usize = 32;
const LEN: usize = HEADER + SLOTS * SLOT;
const OFF_BUDGET: usize = 16;
const OFF_HIGH: usize = 24;
const OFF_CLAIMED: usize = 32;
const OFF_PID: usize = 40;
const OFF_WAIT: usize = 48;
/// How long a namespace counts as waiting for room after a claim of it failed (milliseconds).
pub(in crate::store) const WAIT_MS: u64 = 1000;

/// The root's table, mapped shared.
pub(in crate::store) struct Table {
    map: *mut u8,
    file: File,
    path: PathBuf,
}

// SAFETY: the mapping is only accessed through atomics (claimed, pid, budget) or, for names and `high`,
// under the file's exclusive flock; the pointer stays valid until `Drop` unmaps it.
unsafe impl Send for Table {}
// SAFETY: as for Send: every shared access is atomic or serialized by the flock.
unsafe impl Sync for Table {}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: `map` is the mapping of LEN bytes made in `Table::open`, unmapped once here.
        unsafe { libc::munmap(self.map.cast(), LEN) };
    }
}

/// The file's lock, held while the guard lives.
struct Flock<'a>(&'a File);

impl<'a> Flock<'a> {
    fn new(f: &'a File) -> std::io::Result<Self> {
        // SAFETY: flock on a descriptor we own; blocking is intended (holders keep it for microseconds).
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(f))
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: unlock of a descriptor we own.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Table {
    /// Opens (creating when `create`) the root's table. `Ok(None)`: there is none and `create` is false.
    pub(in crate::store) fn open(root: &Path, create: bool) -> Result<Option<Self>> {
        let path = root.join(BUDGET_FILE);
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(format!("opening {}", path.display()), e)),
        };
        {
            let _g = Flock::new(&file).map_err(|e| io_err("locking BUDGET", e))?;
            let len = file.metadata().map_err(|e| io_err("stat BUDGET", e))?.len();
            let mut h = [0u8; 16];
            // empty, or a header never written: a writer that created the file stopped before it was done
            let fresh = len == 0 || (file.read_exact_at(&mut h, 0).is_ok() && h == [0u8; 16]);
            if fresh && !create {
                return Ok(None);
            }
            if fresh {
                let mut h = vec![0u8; HEADER];
                h[..8].copy_from_slice(&MAGIC.to_le_bytes());
                h[8..12].copy_from_slice(&VERSION.to_le_bytes());
                h[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
                file.set_len(LEN as u64)
                    .and_then(|()| file.write_all_at(&h, 0))
                    .map_err(|e| io_err("creating BUDGET", e))?;
            } else {
                let ok = len == LEN as u64
                    && h[..8] == MAGIC.to_le_bytes()
                    && h[8..12] == VERSION.to_le_bytes()
                    && h[12..16] == (SLOTS as u32).to_le_bytes();
                if !ok {
                    return Err(Error::arg(
                        "path",
                        format!(
                            "{} is not a kvtier budget table of this version (damaged, or written by another \
                             program or kvtier version); remove it with every writer of the store stopped: the \
                             next writer rebuilds it from the namespaces on disk (the budget comes back from \
                             its options, or `kvtier budget`)",
                            path.display()
                        ),
                    ));
                }
            }
        }
        // The file has exactly LEN bytes (checked above) and kvtier never shortens it.
        // SAFETY: a fresh shared mapping of LEN bytes of that file; nothing else aliases it in this process.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(Error::last_os("mmap of BUDGET"));
        }
        Ok(Some(Self {
            map: map.cast(),
            file,
            path,
        }))
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= LEN);
        // Every process accesses these words only atomically.
        // SAFETY: `off` is 8-aligned inside the page-aligned mapping, which lives as long as `self`.
        unsafe { &*self.map.add(off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= LEN);
        // SAFETY: as for `u64_at`, 4-aligned.
        unsafe { &*self.map.add(off).cast::<AtomicU32>() }
    }

    fn claimed(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(HEADER + slot * SLOT + OFF_CLAIMED)
    }

    fn pid(&self, slot: usize) -> &AtomicU32 {
        self.u32_at(HEADER + slot * SLOT + OFF_PID)
    }

    fn waiting(&self, slot: usize) -> &AtomicU64 {
        self.u64_at(HEADER + slot * SLOT + OFF_WAIT)
    }

    /// Namespaces whose writer runs now (`except` counted as one).
    fn live(&self, except: usize) -> u64 {
        1 + (0..self.high())
            .filter(|&s| s != except && process_alive(self.pid(s).load(SeqCst)))
            .count() as u64
    }

    fn high(&self) -> usize {
        (self.u32_at(OFF_HIGH).load(SeqCst) as usize).min(SLOTS)
    }

    /// The budget, 0 when there is none.
    pub(in crate::store) fn budget(&self) -> u64 {
        self.u64_at(OFF_BUDGET).load(SeqCst)
    }

    /// Sets the budget (0: none).
    pub(in crate::store) fn set_budget(&self, bytes: u64) {
        self.u64_at(OFF_BUDGET).store(bytes, SeqCst);
    }

    fn name(&self, slot: usize) -> String {
        // names change only under the flock, which every caller of this holds
        // SAFETY: NAME bytes inside the mapping at the slot's start.
        let b = unsafe { std::slice::from_raw_parts(self.map.add(HEADER + slot * SLOT), NAME) };
        let n = b.iter().position(|&c| c == 0).unwrap_or(NAME);
        String::from_utf8_lossy(&b[..n]).into_owned()
    }

    fn set_name(&self, slot: usize, name: &str) {
        let mut b = [0u8; NAME];
        b[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: NAME bytes inside the mapping; written under the flock, read only under it.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), self.map.add(HEADER + slot * SLOT), NAME)
        };
    }

    /// Sum of the claims of every slot but `except`.
    fn others(&self, except: Option<usize>) -> u64 {
        (0..self.high())
            .filter(|&s| Some(s) != except)
            .map(|s| self.claimed(s).load(SeqCst))
            .fold(0u64, u64::saturating_add)
    }

    /// The slot of namespace directory `name`, taken for a writer (pid set): its own, or a free one.
    /// Before that, namespaces on disk without a slot (written before the table existed, or after it was
    /// rebuilt) get one holding their files' blocks, and slots of directories that no longer exist and
    /// whose writer is gone are freed.
    pub(in crate::store) fn take_slot(&self, root: &Path, name: &str) -> Result<usize> {
        let _g = Flock::new(&self.file).map_err(|e| io_err("locking BUDGET", e))?;
        self.reconcile(root);
        let mine = match self.find(name) {
            Some(s) => s,
            None => self.add(name, 0)?,
        };
        self.pid(mine).store(std::process::id(), SeqCst);
        Ok(mine)
    }

    fn find(&self, name: &str) -> Option<usize> {
        (0..self.high()).find(|&s| self.name(s) == name)
    }

    fn add(&self, name: &str, claimed: u64) -> Result<usize> {
        let Some(s) = (0..SLOTS).find(|&s| s >= self.high() || self.name(s).is_empty()) else {
            return Err(Error::arg(
                "path",
                format!(
                    "{}: {SLOTS} namespaces share this store directory already; remove unused ones \
                     (`kvtier namespaces`, `kvtier remove`)",
                    self.path.display()
                ),
            ));
        };
        self.claimed(s).store(claimed, SeqCst);
        self.pid(s).store(0, SeqCst);
        self.waiting(s).store(0, SeqCst);
        self.set_name(s, name);
        if s >= self.high() {
            self.u32_at(OFF_HIGH).store(s as u32 + 1, SeqCst);
        }
        Ok(s)
    }

    /// Flock held: gives every namespace directory a slot, and frees the slots of directories gone.
    fn reconcile(&self, root: &Path) {
        let Ok(rd) = std::fs::read_dir(root) else {
            return;
        };
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with("ns-") && n.len() <= NAME && self.find(&n).is_none() {
                let _ = self.add(&n, dir_blocks(&e.path()));
            }
        }
        for s in 0..self.high() {
            let n = self.name(s);
            let pid = self.pid(s).load(SeqCst);
            let base = retired_base(&n);
            if !n.is_empty()
                && !root.join(&n).exists()
                && !root.join(format!(".removing-{base}")).exists()
                && !process_alive(pid)
            {
                self.claimed(s).store(0, SeqCst);
                self.set_name(s, "");
            }
        }
    }

    /// Renames the slot of `name` (a directory about to be removed) to a name of its own,
    /// `~<remover pid, 8 hex>ns-…`, and returns that name: the slot keeps counting the directory's blocks
    /// while it is deleted (and, after a forced removal, while its writer still runs, publishing into it),
    /// and a writer that opens the namespace again meanwhile takes a new slot.
    pub(in crate::store) fn retire(&self, name: &str) -> Result<Option<String>> {
        let _g = Flock::new(&self.file).map_err(|e| io_err("locking BUDGET", e))?;
        Ok(self.find(name).map(|s| {
            let retired = format!("~{:08x}{name}", std::process::id());
            self.set_name(s, &retired);
            retired
        }))
    }

    /// Frees the slot of `name` (its directory was removed).
    pub(in crate::store) fn release(&self, name: &str) -> Result<()> {
        let _g = Flock::new(&self.file).map_err(|e| io_err("locking BUDGET", e))?;
        if let Some(s) = self.find(name) {
            self.claimed(s).store(0, SeqCst);
            self.pid(s).store(0, SeqCst);
            self.set_name(s, "");
        }
        Ok(())
    }
}

/// The namespace directory a slot's name counts: its name, or the one a retired slot had (`retire`).
pub(in crate::store) fn retired_base(name: &str) -> &str {
    match name.strip_prefix('~') {
        Some(r) if r.len() > 8 => &r[8..],
        _ => name,
    }
}

/// A slot as a reader sees it: `(namespace directory, claimed bytes, writer pid or 0)`.
pub(in crate::store) type SlotView = (String, u64, u32);

/// The root's table as a reader sees it, without locking or mapping it (a read-only file system works):
/// `(budget, [(namespace directory, claimed, pid)])`; `None` when the root has none. Values are read
/// with `pread`, each word whole on the platforms kvtier runs on; a display, not a decision.
pub(in crate::store) fn read_table(root: &Path) -> Result<Option<(u64, Vec<SlotView>)>> {
    let path = root.join(BUDGET_FILE);
    let b = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(format!("reading {}", path.display()), e)),
    };
    if b.len() < 16 || b[..16] == [0u8; 16] {
        return Ok(None); // never initialized (see `Table::open`)
    }
    let word = |off: usize| u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"));
    if b.len() != LEN || word(0) != MAGIC || b[8..12] != VERSION.to_le_bytes() {
        return Err(Error::arg(
            "path",
            format!(
                "{} is not a kvtier budget table of this version",
                path.display()
            ),
        ));
    }
    let high =
        (u32::from_le_bytes(b[OFF_HIGH..OFF_HIGH + 4].try_into().expect("4")) as usize).min(SLOTS);
    let slots = (0..high)
        .filter_map(|s| {
            let at = HEADER + s * SLOT;
            let raw = &b[at..at + NAME];
            let n = raw.iter().position(|&c| c == 0).unwrap_or(NAME);
            let pid = u32::from_le_bytes(b[at + OFF_PID..at + OFF_PID + 4].try_into().expect("4"));
            (n > 0).then(|| {
                (
                    String::from_utf8_lossy(&raw[..n]).into_owned(),
                    word(at + OFF_CLAIMED),
                    pid,
                )
            })
        })
        .collect();
    Ok(Some((word(OFF_BUDGET), slots)))
}

/// Bytes of disk blocks the files of a directory hold (`st_blocks`).
pub(in crate::store) fn dir_blocks(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn process_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let rc = unsafe { libc::kill(pid as i32, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

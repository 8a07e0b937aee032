//! The commit path: the journal file, the commit lock that orders every change of which keys exist, the
//! prepaid delete reserve (docs/STORE.md, rules R1 and R4); compaction is `compact`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use crate::store::index::{Entry, JOURNAL_SLACK};
use crate::store::journal::{encoded_len, put_len, Placement, PutParts, Record};
use crate::store::space::files::fallocate;

/// A put to commit: its key and where its bytes were written.
pub(in crate::store) type PutItem = (String, Placement);
use crate::error::{Error, Result};
use crate::fault;
use crate::store::stats::phase;
use crate::store::{io_err, Shared};

/// Journal growth step beyond what a commit needs: 1 MiB, at most a 64th of the capacity (and never more
/// than the capacity left).
const JOURNAL_STEP: u64 = 1 << 20;
/// Compaction waits for the journal to pass this size (less in small stores; `Index::compact_trigger`).
const COMPACT_MIN: u64 = 1 << 20;

/// The journal file. Held behind the commit lock (`Log::journal`, in the order of `log::locks`).
pub(in crate::store) struct JournalFile {
    pub(in crate::store) file: File,
    pub(in crate::store) path: PathBuf,
    /// Set when a failed append could not be cut back: later mutations fail until the store is reopened.
    pub(in crate::store) poisoned: Option<String>,
    /// The journal length at which the next compaction is tried.
    pub(in crate::store) compact_at: u64,
    /// The threshold `compact_at` returns to after a compaction.
    pub(in crate::store) compact_base: u64,
    /// A failed append was cut back since the journal file was last replaced. A follower may have read
    /// the cut records; the records appended in their place then have the same file and, soon, a length
    /// past its offset, so it would take them for records it has read and never apply them (an object
    /// acknowledged since would be a miss for it until the next compaction). A new file makes every
    /// follower rebuild: the next compaction step starts one whatever the journal's length.
    pub(in crate::store) rewrite_due: bool,
}

impl JournalFile {
    pub(in crate::store) fn open(path: &Path, writable: bool, capacity: u64) -> io::Result<Self> {
        let file = if writable {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)?;
            // at every writable open, not only when the file is new: an open that created the journal and
            // failed to sync its name leaves a file the next open must not take as durable
            if let Some(dir) = path.parent() {
                crate::store::space::disk::sync_dir(dir)?;
            }
            f
        } else {
            File::open(path)?
        };
        Ok(Self {
            file,
            path: path.to_owned(),
            poisoned: None,
            compact_at: compact_base(capacity),
            compact_base: compact_base(capacity),
            rewrite_due: false,
        })
    }

    /// Writes `buf` at `end` and makes it durable. On failure the file is cut back to `end` (and synced,
    /// so the failed records cannot come back after a crash); if that fails too the journal is poisoned.
    fn append(&mut self, buf: &[u8], end: u64) -> io::Result<()> {
        if let Some(why) = &self.poisoned {
            return Err(io::Error::other(format!(
                "journal poisoned by an earlier failure ({why}); reopen the store"
            )));
        }
        let res = match fault::take("journal_write") {
            Some(fault::Fault::Short(e)) => self
                .file
                .write_all_at(&buf[..buf.len() / 2], end)
                .and(Err(io::Error::from_raw_os_error(e))),
            other => fault::apply(other).and_then(|()| self.file.write_all_at(buf, end)),
        }
        .and_then(|()| fault::check("journal_sync"))
        .and_then(|()| self.file.sync_data());
        if let Err(e) = &res {
            self.rewrite_due = true;
            let cut = fault::check("journal_cut")
                .and_then(|()| self.file.set_len(end))
                .and_then(|()| self.file.sync_all());
            if let Err(c) = cut {
                self.poisoned = Some(format!("append failed ({e}), cut back failed ({c})"));
            }
        }
        res
    }

    /// Preallocates blocks up to `target` bytes without changing the length; `from` is what is already
    /// reserved. A failed attempt gives back what it may have allocated past `from`.
    fn reserve(&self, from: u64, target: u64) -> io::Result<()> {
        let r = fault::check("journal_reserve").and_then(|()| {
            fallocate(&self.file, libc::FALLOC_FL_KEEP_SIZE, 0, target).or_else(|e| {
                // file systems without fallocate: nothing can be reserved ahead; appends claim space
                if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                    Ok(())
                } else {
                    Err(e)
                }
            })
        });
        if r.is_err() && target > from {
            let _ = crate::store::space::files::punch(&self.file, from, target - from);
        }
        r
    }
}

/// Journal size from which compaction is considered: 1 MiB, less for small stores (a 64th of the
/// capacity): the capacity holds room for the journal up to this size (`Index::journal_budget`).
pub(in crate::store) fn compact_base(capacity: u64) -> u64 {
    COMPACT_MIN.min(capacity / 64)
}

fn round_up(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

fn encode(recs: &[Record]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(recs.len() * 100);
    for r in recs {
        r.encode(&mut buf);
    }
    buf
}

impl Shared {
    pub(in crate::store) fn writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::Os {
                what: format!("page store {} was opened read-only", self.dir.display()),
                source: io::Error::from_raw_os_error(libc::EROFS),
            });
        }
        Ok(())
    }

    /// Appends `recs` durably (commit lock held by the caller through `j`), advancing the index's journal
    /// end. Nothing in the index changes here.
    fn append_locked(&self, j: &mut JournalFile, recs: &[Record]) -> io::Result<()> {
        if recs.is_empty() {
            return Ok(());
        }
        let buf = encode(recs);
        let end = self.log.index().j_end;
        let r = j.append(&buf, end);
        match &r {
            Ok(()) => {
                let mut ix = self.log.index();
                ix.j_end = end + buf.len() as u64;
                // appends past the reserve (none was possible) claimed their blocks themselves
                ix.j_alloc = ix.j_alloc.max(round_up(ix.j_end));
            }
            Err(_) => {
                self.stats.journal_failures.fetch_add(1, Ordering::Relaxed);
                if j.poisoned.is_some() {
                    self.poisoned.store(true, Ordering::Relaxed);
                } else {
                    // Cutting the file back also drops the blocks preallocated past its end (ext4, tmpfs,
                    // XFS): put the delete reserve back, or count it as gone so the next commit regrows it.
                    let had = self.log.index().j_alloc;
                    if j.reserve(round_up(end), had).is_err() {
                        self.log.index().j_alloc = round_up(end);
                    }
                }
            }
        }
        r
    }

    /// Makes sure the journal has blocks for `extra` more bytes beyond everything it owes (R4): grows the
    /// reserve within the capacity. Commit lock held through `j`.
    fn ensure_reserve(&self, j: &JournalFile, extra: u64) -> io::Result<()> {
        let (need, target, from) = {
            let mut ix = self.log.index();
            let need = round_up(ix.j_end + ix.del_bytes + JOURNAL_SLACK + extra);
            if ix.j_alloc >= need {
                return Ok(());
            }
            let room = self.limit().saturating_sub(ix.data_alloc);
            if need > room {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            let step = JOURNAL_STEP.min(self.opts.capacity_bytes / 64 / 4096 * 4096);
            let mut target = round_up(need + step).min(room / 4096 * 4096).max(need);
            // claimed in the root's budget before the blocks are allocated: the step if it fits, else what
            // this commit needs
            let with = |t: u64| ix.data_alloc + t.max(round_up(ix.journal_budget()));
            if !self.fits(&ix, with(target)) {
                target = need;
                if !self.fits(&ix, with(need)) {
                    return Err(io::Error::from_raw_os_error(libc::ENOSPC));
                }
            }
            // counted before the lock is released, so a concurrent reservation sees the journal's growth
            let from = ix.j_alloc;
            ix.j_alloc = target;
            (need, target, from)
        };
        let got = match j.reserve(from, target) {
            Ok(()) => Ok(target),
            // a nearly full disk: the step does not fit, what this commit needs may
            Err(_) if target > need => j.reserve(from, need).map(|()| need),
            Err(e) => Err(e),
        };
        let mut ix = self.log.index();
        match got {
            Ok(n) => {
                ix.j_alloc = n;
                Ok(())
            }
            Err(e) => {
                ix.j_alloc = from;
                Err(e)
            }
        }
    }

    /// Commits put records of objects whose bytes are durable: reserve, append, then insert (R1). On error
    /// nothing was inserted.
    pub(in crate::store) fn commit_puts(&self, items: &[PutItem]) -> io::Result<()> {
        let mut t = std::time::Instant::now();
        let mut j = self.log.journal();
        // each put's record (with the optional parts it carries) and its prepaid del
        let new: u64 = items
            .iter()
            .map(|(key, at)| (encoded_len(key.len()) + put_len(key.len(), PutParts::of(at))) as u64)
            .sum();
        self.ensure_reserve(&j, new)?;
        self.stats.lap(phase::JOURNAL_RESERVE, &mut t);
        let recs: Vec<Record> = items
            .iter()
            .map(|(key, at)| Record::Put {
                key: key.clone(),
                at: *at,
            })
            .collect();
        self.append_locked(&mut j, &recs)?;
        self.stats.lap(phase::JOURNAL_APPEND, &mut t);
        let mut ix = self.log.index();
        for (key, at) in items {
            ix.insert(key, Entry::from(*at));
        }
        drop(ix);
        self.stats.lap(phase::INDEX_INSERT, &mut t);
        Ok(())
    }

    /// Deletes `victims` `(key, gen)` that are still that very object (not re-put since) — del records
    /// durable first, then removed (R1). Returns the keys removed. Used by eviction, by dropping corrupt
    /// objects and by repair.
    pub(in crate::store) fn commit_dels(
        &self,
        victims: &[(String, u64)],
    ) -> io::Result<Vec<String>> {
        let mut j = self.log.journal();
        let still: Vec<String> = {
            let ix = self.log.index();
            let mut seen = std::collections::HashSet::new();
            victims
                .iter()
                .filter(|(k, g)| {
                    ix.map.get(k.as_str()).is_some_and(|e| e.gen == *g) && seen.insert(k)
                })
                .map(|v| v.0.clone())
                .collect()
        };
        self.dels_locked(&mut j, still)
    }

    fn dels_locked(&self, j: &mut JournalFile, keys: Vec<String>) -> io::Result<Vec<String>> {
        let recs: Vec<Record> = keys
            .iter()
            .map(|k| Record::Del { key: k.clone() })
            .collect();
        let mut t = std::time::Instant::now();
        self.append_locked(j, &recs)?;
        self.stats.lap(phase::EVICT_APPEND, &mut t);
        let mut ix = self.log.index();
        for k in &keys {
            ix.remove(k);
        }
        Ok(keys)
    }

    /// Deletes keys; returns how many existed. Durable when it returns; on an error nothing was deleted.
    pub fn delete(&self, keys: &[&str]) -> Result<usize> {
        self.writable()?;
        for k in keys {
            Self::check_journal_key(k)?;
        }
        match self.stored_names(keys.iter().copied(), true)? {
            Some(names) => {
                self.delete_stored(&names.iter().map(String::as_str).collect::<Vec<_>>())
            }
            None => self.delete_stored(keys),
        }
    }

    /// [`Shared::delete`] of names as the store keeps them (checked by the caller).
    pub(in crate::store) fn delete_stored(&self, keys: &[&str]) -> Result<usize> {
        let mut j = self.log.journal();
        let present: Vec<String> = {
            let ix = self.log.index();
            let mut seen = std::collections::HashSet::new();
            keys.iter()
                .filter(|k| ix.map.contains_key(**k) && seen.insert(**k))
                .map(|k| (*k).to_owned())
                .collect()
        };
        let n = self
            .dels_locked(&mut j, present)
            .map_err(|e| io_err("appending del records to journal.log", e))?
            .len();
        drop(j);
        self.compact_step();
        self.settle();
        self.persist_stats(false);
        Ok(n)
    }

    /// Deletes every object of this namespace.
    pub fn clear(&self) -> Result<usize> {
        let keys = self.keys();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.writable()?;
        self.delete_stored(&refs)
    }

    /// Appends del records for keys that are not in the index (replay's dropped keys); best effort.
    pub(in crate::store) fn append_forgotten(&self, keys: Vec<String>) {
        let recs: Vec<Record> = keys.into_iter().map(|key| Record::Del { key }).collect();
        let mut j = self.log.journal();
        let _ = self.append_locked(&mut j, &recs);
    }

    /// Establishes the delete reserve at open; on failure the store opens with a note and puts fail until
    /// a commit can grow it.
    pub(in crate::store) fn establish_reserve(&self) -> Option<String> {
        let j = self.log.journal();
        self.ensure_reserve(&j, 0).err().map(|e| {
            format!(
                "the journal's delete reserve could not be allocated ({e}); puts fail until it can"
            )
        })
    }

    /// At a writable open over its capacity: gives back the journal's blocks past what it needs before
    /// anything is evicted. A store used with a larger capacity preallocated a larger reserve (its growth
    /// step is a 64th of the capacity, up to 1 MiB); reopened with a smaller one, eviction would otherwise
    /// pay for that reserve with acknowledged objects and still not get under the limit. The file is cut
    /// to its length (ext4 and XFS drop the blocks preallocated past it) and the range past it punched
    /// (tmpfs), then the reserve is grown again to what this capacity wants (R4). Between the two another
    /// process could take the space: the open then reports that puts fail until the reserve can be grown,
    /// as on any full disk; deletes and eviction need no more than the journal then holds.
    pub(in crate::store) fn shrink_reserve(&self) {
        let j = self.log.journal();
        let (end, held, need) = {
            let ix = self.log.index();
            if ix.occupancy_with(0, 0) <= self.limit() {
                return;
            }
            (ix.j_end, ix.j_alloc, round_up(ix.journal_need()))
        };
        if held <= need {
            return;
        }
        let from = round_up(end);
        let _ = j.file.set_len(end);
        let _ = crate::store::space::files::punch(&j.file, from, held - from);
        let _ = j.file.sync_all();
        let now = crate::store::space::files::extent_bytes(&j.file).div_ceil(4096) * 4096;
        self.log.index().j_alloc = from.max(now);
        let _ = self.ensure_reserve(&j, 0);
    }
}

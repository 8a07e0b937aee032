//! Journal compaction, in steps between commits (docs/STORE.md, "Compaction"). A compaction starts when the
//! journal's dead records are as many bytes as its live ones. Its steps run on the writer's background
//! thread, handed over by put batches that do not wait for them (`worker`), or after a delete call, outside
//! the commit lock, each doing work in proportion to what the journal grew by since the last one:
//! first the walk (put records of the entries live at the start, oldest first, a chunk at a time under the
//! index lock), then the tail (the records the old journal got since the start, copied as they are), each
//! step synced. Only the records committed since the finish's own sync, the rename and the directory sync
//! hold the commit lock.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::Ordering;

use crate::error::Result;
use crate::fault;
use crate::store::index::JOURNAL_SLACK;
use crate::store::journal;
use crate::store::space::files::fallocate;
use crate::store::{io_err, Shared};

/// Bytes a step writes for each byte the journal grew by since the last step: a compaction rewrites the
/// live records `L` and the tail `g` appended meanwhile, so it ends once `4g >= L + g`, when the journal
/// has grown by a third of `L` past the trigger (`2L`), before its allowance (`2.5L`,
/// `Index::journal_allowance`). (8 made a full store's steps 30–150 ms on a loaded 2-core machine, the
/// walk's CPU most of it.)
const STEP_FACTOR: u64 = 4;
/// The least a step writes, so small commits still move a compaction along.
const STEP_MIN: u64 = 16 << 10;
/// Entries encoded per hold of the index lock.
const CHUNK: usize = 512;
/// The longest record (a put carrying every optional part, with a key of `journal::MAX_KEY` bytes).
const MAX_RECORD: u64 = journal::put_len(journal::MAX_KEY, journal::PutParts::ALL) as u64;

/// A replaced journal holding at least this many bytes is closed by the background thread (freeing 1 MiB
/// of blocks costs about 0.3 ms on ext4); a smaller one in the call. Tests lower it.
pub(in crate::store) static CLOSE_IN_BACKGROUND_FROM: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(CLOSE_IN_BACKGROUND_DEFAULT);
/// [`CLOSE_IN_BACKGROUND_FROM`]'s value.
pub(in crate::store) const CLOSE_IN_BACKGROUND_DEFAULT: u64 = 4 << 20;

/// Tests: called by a compaction's finish between its sync and taking the commit lock.
#[cfg(test)]
pub(in crate::store) static FINISH_HOOK: std::sync::Mutex<Option<fn(&Shared)>> =
    std::sync::Mutex::new(None);

/// Tests: called at each point of a step where a crash or another thread's commit can come: `"step"`
/// (before it starts or resumes the compaction), `"written"` (a step's records written, not yet synced),
/// `"synced"` (a step's records synced), `"finish"` (the finish's sync done, the commit lock not yet taken).
#[cfg(test)]
pub(in crate::store) static STEP_HOOK: std::sync::Mutex<Option<StepHook>> =
    std::sync::Mutex::new(None);
#[cfg(test)]
pub(in crate::store) type StepHook = fn(&Shared, &'static str);

#[cfg(test)]
fn step_hook(s: &Shared, point: &'static str) {
    let hook = *STEP_HOOK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(hook) = hook {
        hook(s, point);
    }
}
#[cfg(not(test))]
fn step_hook(_: &Shared, _: &'static str) {}

/// A compaction in progress: the new journal (`journal.compact`) being written.
pub(in crate::store) struct Compaction {
    file: File,
    /// A handle on the old journal, to copy its tail from.
    old: File,
    /// The old journal's length when the compaction started: its records from here on are the tail.
    start: u64,
    /// Bytes of the new journal written.
    written: u64,
    /// How far the old journal's tail is copied (an offset in it); `None` while the walk runs.
    copied: Option<u64>,
    /// The old journal's length at the last step.
    seen_end: u64,
}

impl Compaction {
    /// Whether the walk over the live entries is done (the tail is being copied).
    #[cfg(test)]
    pub(in crate::store) fn walked(&self) -> bool {
        self.copied.is_some()
    }
}

fn round_up(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

/// Preallocates the new journal's first `bytes` (its length unchanged); file systems without fallocate
/// reserve nothing ahead, as for the journal itself.
fn new_journal_reserve(f: &File, bytes: u64) -> io::Result<()> {
    fault::check("journal_reserve")?;
    fallocate(f, libc::FALLOC_FL_KEEP_SIZE, 0, bytes).or_else(|e| {
        if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
            Ok(())
        } else {
            Err(e)
        }
    })
}

impl Shared {
    /// Hands a step to the background thread if a compaction runs or the journal is due for one, unless a
    /// step is queued already (`worker`). A put batch calls it and never waits for the step.
    pub(in crate::store) fn step_in_background(&self) {
        if self.read_only || !self.compaction_wanted() {
            return;
        }
        if self.step_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        self.worker
            .run(crate::store::worker::Job::Step(self.me.clone()));
    }

    /// Whether a compaction is running (a step is due) or the journal is due for one. It waits for no lock:
    /// one another thread holds (a step's walk, a finish's switch, a commit) counts as "wanted", and the
    /// step decides (a batch waited up to 169 ms in this check once, at load, when it took the locks).
    fn compaction_wanted(&self) -> bool {
        if self.log.try_compaction().is_none_or(|c| c.is_some()) {
            return true; // running, or a step holds its lock now (a queued one follows if it has work)
        }
        let (Some(ix), Some(j)) = (self.log.try_index(), self.log.try_journal()) else {
            return true;
        };
        j.rewrite_due || (ix.j_end >= ix.compact_trigger() && ix.j_end >= j.compact_at)
    }

    /// One step of the running compaction, or the start of one if the journal is due (a no-op while
    /// another thread steps it). Called by the background thread and after a delete, outside every lock.
    pub(in crate::store) fn compact_step(&self) {
        if self.read_only {
            return;
        }
        step_hook(self, "step");
        let Some(mut running) = self.log.try_compaction() else {
            return;
        };
        let c = match running.take() {
            Some(c) => c,
            None => {
                let (end, trigger) = {
                    let ix = self.log.index();
                    (ix.j_end, ix.compact_trigger())
                };
                let j = self.log.journal();
                // after a cut-back, a new file at once: followers rebuild (`JournalFile::rewrite_due`)
                if !j.rewrite_due && (end < trigger || end < j.compact_at) {
                    return;
                }
                drop(j);
                match self.compaction_begin() {
                    Ok(c) => c,
                    Err(_) => return self.compaction_failed(),
                }
            }
        };
        let end = self.log.index().j_end;
        let budget = (STEP_FACTOR * end.saturating_sub(c.seen_end)).max(STEP_MIN);
        match self.compaction_work(c, budget) {
            Ok(left) => *running = left,
            Err(_) => self.compaction_failed(),
        }
    }

    /// Whether a compaction is running (a thread may be stepping it now).
    #[cfg(test)]
    pub(in crate::store) fn compaction_running(&self) -> bool {
        !self.read_only && self.log.try_compaction().is_none_or(|c| c.is_some())
    }

    /// Compacts now and to the end (the running compaction, or a new one), waiting for a step in another
    /// thread: at open, by `kvtier verify --repair` (it drops damaged spans), and when a batch finds only
    /// the journal short of room.
    pub fn compact(&self) -> Result<()> {
        self.writable()?;
        let mut running = self.log.compaction();
        let r = match running.take() {
            Some(c) => Ok(c),
            None => self.compaction_begin(),
        }
        .and_then(|c| self.compaction_work(c, u64::MAX));
        match r {
            Ok(left) => {
                debug_assert!(left.is_none(), "an unbounded step finishes the compaction");
                *running = left;
                Ok(())
            }
            Err(e) => {
                self.compaction_failed();
                Err(io_err("compacting journal.log", e))
            }
        }
    }

    /// Creates `journal.compact` and, under the commit lock, fixes the start: the journal's length and the
    /// walk over the entries live now (while the lock is held, the index is the replay of exactly that
    /// journal: R1).
    pub(in crate::store) fn compaction_begin(&self) -> io::Result<Compaction> {
        let tmp = self.dir.join("journal.compact");
        let _ = std::fs::remove_file(&tmp);
        fault::check("compact")?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        let j = self.log.journal();
        if let Some(why) = &j.poisoned {
            return Err(io::Error::other(why.clone()));
        }
        let old = j.file.try_clone()?;
        let mut ix = self.log.index();
        ix.start_walk();
        Ok(Compaction {
            file,
            old,
            start: ix.j_end,
            written: 0,
            copied: None,
            seen_end: ix.j_end,
        })
    }

    /// One step: about `budget` bytes of the new journal (walk, then tail), synced. When the tail left
    /// fits the step, the compaction is finished. Returns the compaction if it is still running.
    pub(in crate::store) fn compaction_work(
        &self,
        mut c: Compaction,
        budget: u64,
    ) -> io::Result<Option<Compaction>> {
        c.seen_end = self.log.index().j_end;
        // no chunk writes more than the budget (a record has at most MAX_RECORD bytes)
        let chunk = (budget / MAX_RECORD).clamp(1, CHUNK as u64) as usize;
        let mut done = 0u64;
        let mut buf = Vec::new();
        while c.copied.is_none() && done < budget {
            buf.clear();
            let walked = self.log.index().walk_chunk(chunk, &mut buf);
            fault::check("compact")?;
            c.file.write_all_at(&buf, c.written)?;
            c.written += buf.len() as u64;
            done += buf.len() as u64;
            if walked {
                c.copied = Some(c.start);
            }
        }
        let Some(from) = c.copied else {
            step_hook(self, "written");
            c.file.sync_data()?;
            step_hook(self, "synced");
            return Ok(Some(c));
        };
        let end = self.log.index().j_end;
        let left = budget.saturating_sub(done);
        if end - from > left {
            // more tail than this step copies: a piece now (never less than a whole record), the rest later
            self.copy_tail(&mut c, from, from + left.max(MAX_RECORD))?;
            step_hook(self, "written");
            c.file.sync_data()?;
            step_hook(self, "synced");
            return Ok(Some(c));
        }
        self.copy_tail(&mut c, from, end)?;
        // no sync here: the finish syncs the whole file (`sync_all`) before the rename, one sync fewer
        let mut t = std::time::Instant::now();
        let r = self.compaction_finish(c).map(|()| None);
        self.stats
            .lap(crate::store::stats::phase::COMPACT_FINISH, &mut t);
        r
    }

    /// Copies the old journal's records in `[from, to)` to the new one (`to` is cut to the committed
    /// length). A piece that ends at the committed length ends at a record boundary and is parsed with
    /// resynchronisation, as a journal is at open; a shorter one takes only the whole records at its
    /// start (strict parsing: the record it cuts is read again by the next piece).
    fn copy_tail(&self, c: &mut Compaction, from: u64, to: u64) -> io::Result<()> {
        let end = self.log.index().j_end;
        let to = to.min(end);
        let mut piece = vec![0u8; (to - from) as usize];
        c.old.read_exact_at(&mut piece, from)?;
        let (records, used) = if to == end {
            (journal::parse_resync(&piece).records, piece.len())
        } else {
            journal::parse(&piece)
        };
        if used == 0 && to < end {
            // a damaged record at the start of a piece (a piece holds at least one whole record):
            // resynchronise over the committed rest
            return self.copy_tail(c, from, end);
        }
        let mut out = Vec::with_capacity(used);
        for r in &records {
            r.encode(&mut out);
        }
        fault::check("compact")?;
        c.file.write_all_at(&out, c.written)?;
        c.written += out.len() as u64;
        c.copied = Some(from + used as u64);
        Ok(())
    }

    /// The delete reserve (R4) of the new journal for the records it holds and a del of every live key,
    /// and a sync, outside the commit lock; then, under it: the records committed since, more reserve if
    /// they need it and a sync if anything changed, `rename` over `journal.log`, `fsync` of the directory;
    /// then the new file takes the old one's place. (The reserve's `fallocate` and the sync of the whole
    /// file were under the lock, with the old journal's close: a finish took 41-256 ms at load.)
    fn compaction_finish(&self, mut c: Compaction) -> io::Result<()> {
        let mut t = std::time::Instant::now();
        let need =
            |c: &Compaction| round_up(c.written + self.log.index().del_bytes + JOURNAL_SLACK);
        let mut reserved = need(&c);
        new_journal_reserve(&c.file, reserved)?;
        c.file.sync_all()?;
        let synced = c.written;
        self.stats
            .lap(crate::store::stats::phase::COMPACT_SYNC, &mut t);
        #[cfg(test)]
        if let Some(hook) = *FINISH_HOOK.lock().unwrap_or_else(|p| p.into_inner()) {
            hook(self); // commits between this sync and the lock (tests::background)
        }
        step_hook(self, "finish");
        let mut j = self.log.journal();
        if let Some(why) = &j.poisoned {
            return Err(io::Error::other(why.clone()));
        }
        let from = c.copied.expect("the tail is being copied");
        let end = self.log.index().j_end;
        if end > from {
            self.copy_tail(&mut c, from, end)?;
        }
        // the new journal must carry the delete reserve too (R4), or it could not replace the old one
        let grown = need(&c) > reserved;
        if grown {
            reserved = need(&c);
            new_journal_reserve(&c.file, reserved)?;
        }
        if grown || c.written > synced {
            c.file.sync_all()?;
        }
        std::fs::rename(self.dir.join("journal.compact"), &j.path)?;
        // From here the new file is journal.log: it must become the handle appends go to, whatever happens
        // next. Until the directory is synced the rename may not survive a crash (the old journal would
        // come back without the records appended to the new one): if that sync fails, the journal is
        // poisoned and nothing more is acknowledged until a reopen.
        let dir_synced = crate::store::space::disk::sync_dir(&self.dir); // (the `dir_sync` fault point)
        self.stats.lap(crate::store::stats::phase::DIR_SYNC, &mut t);
        let old = std::mem::replace(&mut j.file, c.file);
        j.poisoned = dir_synced
            .err()
            .map(|e| format!("the directory could not be synced after compaction ({e})"));
        let poisoned = j.poisoned.is_some();
        self.poisoned.store(poisoned, Ordering::Relaxed);
        j.compact_at = j.compact_base;
        j.rewrite_due = false;
        let mut ix = self.log.index();
        let old_bytes = ix.j_alloc;
        ix.j_end = c.written;
        ix.j_alloc = reserved.max(round_up(c.written));
        self.stats.compactions.fetch_add(1, Ordering::Relaxed);
        drop(ix);
        drop(j);
        // The old journal is unlinked: its last close frees its blocks, 27-32 ms for a 100 MB journal on
        // ext4, which this batch (and every commit waiting for the lock) paid. A large one is closed by the
        // background thread (`worker`), cut a piece at a time first if its rename is durable; a small one
        // here, after the locks, so that its blocks are given back before the call returns, as they always
        // were.
        if old_bytes >= CLOSE_IN_BACKGROUND_FROM.load(Ordering::Relaxed) {
            use crate::store::worker::Job;
            self.worker.run(Job::Close(c.old));
            self.worker.run(if poisoned {
                Job::Close(old)
            } else {
                Job::CutAndClose(old, self.me.clone())
            });
        }
        Ok(())
    }

    /// A compaction that failed (its file is closed): the file removed, the walk ended, and no new one
    /// until the journal has doubled.
    pub(in crate::store) fn compaction_failed(&self) {
        let _ = std::fs::remove_file(self.dir.join("journal.compact"));
        let j = &mut *self.log.journal();
        // given up too: a disk that fails a compaction would fail it again at every step
        j.rewrite_due = false;
        let mut ix = self.log.index();
        ix.walk = None;
        j.compact_at = ix.j_end.saturating_mul(2).max(j.compact_base);
    }
}

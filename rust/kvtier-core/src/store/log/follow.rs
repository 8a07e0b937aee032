//! Read-only stores follow the namespace's writer (another process: SGLang's MLA ranks other than the one
//! that writes, `kvtier inspect` on a live store). A lookup that misses a key, and any lookup once
//! [`RECHECK`] has passed since the last look, first applies the records the writer appended since then
//! (one `stat` of the journal tells whether there are any); when the writer compacted (a new journal file)
//! or the journal shrank, the index is rebuilt from the whole journal. So an object the writer acknowledged
//! before a lookup began is always found by it, and lookups that hit cost no system call. A follower never writes, so it cannot hurt the writer; the
//! writer may meanwhile reuse a slot the follower still maps to an older key — reading it then fails that
//! key's checksum (a miss, never wrong bytes), and the writer's del record arrives at the next refresh.

use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::time::{Duration, Instant};

use super::recovery;
use crate::store::index::{Entry, Index};
use crate::store::journal::put_shape_ok;
use crate::store::journal::{self, Record};
use crate::store::stats::OpenReport;
use crate::store::Shared;

/// How long lookups that find every key go without looking at the journal: the longest a follower keeps
/// an object the writer has deleted (its bytes, verified, are still the key's own: a slot the writer reuses
/// fails the old key's checksum).
pub(in crate::store) const RECHECK: Duration = Duration::from_millis(100);

/// Where a follower is in the writer's journal.
pub(in crate::store) struct Follow {
    /// Device and inode of the journal file read so far (a compaction renames a new file over it). That
    /// file stays open (the store's journal handle, behind `Log::journal`) until the follower moves to a
    /// newer one: while it is open no other file can take its inode number, so an equal number is the same
    /// file. (A freed number is handed out again at once on ext4: a follower that had let go of its file
    /// and missed two compactions took the third journal, which had its number, for the one it read grown,
    /// read it from its old offset and never saw the records before that.)
    ino: (u64, u64),
    /// Bytes of it applied (up to the last whole record).
    offset: u64,
    /// When the journal was last looked at.
    checked: Instant,
    /// How many times it was looked at.
    pub(in crate::store) looks: u64,
}

impl Follow {
    pub(in crate::store) fn new(ino: (u64, u64), offset: u64) -> Self {
        Self {
            ino,
            offset,
            checked: Instant::now(),
            looks: 0,
        }
    }
}

/// Applies one record to a follower's index (replay's rules, without the data-file length check: a record
/// naming bytes the file lacks reads as an IO error, a miss).
fn apply(ix: &mut Index, r: Record) {
    match r {
        Record::Put { key, at } => {
            let (class, slot) = (at.class, at.slot);
            if !put_shape_ok(class, at.len) {
                ix.remove(&key);
                return;
            }
            let n = ix.next.entry(class).or_insert(0);
            *n = (*n).max(slot.saturating_add(1));
            ix.used += u64::from(class);
            ix.data_alloc += u64::from(class);
            ix.insert(&key, Entry::from(at));
        }
        Record::Del { key } => {
            ix.remove(&key);
        }
    }
}

impl Shared {
    /// Before a lookup of `keys` (all keys: `None`): brings a read-only store up to date with its writer's
    /// journal if a key is not in its index or [`RECHECK`] has passed since the last look (a no-op for
    /// writable stores).
    pub(in crate::store) fn refresh_for(&self, keys: Option<&[&str]>) {
        if !self.log.follows() {
            return;
        }
        let missing = keys.is_none_or(|keys| {
            let ix = self.log.index();
            keys.iter().any(|k| ix.get(k).is_none())
        });
        let Some(mut st) = self.log.follow() else {
            return;
        };
        if !missing && st.checked.elapsed() < RECHECK {
            return;
        }
        st.checked = Instant::now();
        st.looks += 1;
        self.refresh(&mut st);
    }

    /// Applies what the writer appended since the last look, or rebuilds the index after a compaction.
    /// IO errors leave the index as it was: a follower then serves what it knew, checksum-verified.
    fn refresh(&self, st: &mut Follow) {
        let path = self.dir.join("journal.log");
        let Ok(md) = std::fs::metadata(&path) else {
            return;
        };
        // the file read so far, held open (after the follow lock, in the log's order: `log::locks`; a
        // read-only store takes the journal lock nowhere else on a lookup's path)
        let mut j = self.log.journal();
        if (md.dev(), md.ino()) != st.ino || md.len() < st.offset {
            // compacted or cut: rebuild from the whole journal, read through the handle that is kept (a
            // name looked up twice could be two files)
            let Ok(file) = std::fs::File::open(&path) else {
                return;
            };
            let Ok(fmd) = file.metadata() else {
                return;
            };
            let mut bytes = Vec::new();
            if (&file).read_to_end(&mut bytes).is_err() {
                return;
            }
            let parsed = journal::parse_resync_with(&bytes, recovery::Rec::of);
            let mut report = OpenReport::default();
            let Ok((mut ix, _)) =
                recovery::replay(&self.dir, &bytes, parsed.records, &mut report, 0)
            else {
                return;
            };
            recovery::trim_data_files(&self.dir, &mut ix, false);
            ix.j_end = parsed.valid_end as u64;
            *self.log.index() = ix;
            st.ino = (fmd.dev(), fmd.ino());
            st.offset = parsed.valid_end as u64;
            j.file = file; // the journal read before is let go
            return;
        }
        if md.len() == st.offset {
            return;
        }
        // the same file as the one held (its number cannot have been reused while it is open): read it
        // through the handle, which a rename since the `stat` cannot swap for another file
        let mut chunk = vec![0u8; (md.len() - st.offset) as usize];
        if j.file.read_exact_at(&mut chunk, st.offset).is_err() {
            return;
        }
        drop(j);
        // whole records only: an append in progress is read again next time
        let parsed = journal::parse_resync(&chunk);
        let mut ix = self.log.index();
        for r in parsed.records {
            apply(&mut ix, r);
        }
        st.offset += parsed.valid_end as u64;
        ix.j_end = st.offset;
    }
}

//! The writer's counters on disk: `STATS` in the namespace directory, a JSON object rewritten atomically (a
//! temporary file renamed over it) after a batch at most every [`EVERY_MS`] and when the store closes, so
//! `kvtier stats` can show a live or a finished writer's traffic (docs/STORE.md, "Counters on disk"). Not
//! synced: the counters are advice, and a crash costs at most the last few seconds of them. A running
//! writer's rewrites are done by its background thread (`worker`), off the put path; the last one, at
//! close, after that thread has stopped. A maintenance open ([`crate::store::PageStore::open_maintenance`]) loads
//! the file first and keeps what it holds: an erase or a repair does not wipe the engine's counters.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::store::{PageStore, Shared};

/// The file's name in the namespace directory.
pub const STATS_FILE: &str = "STATS";
/// Least time between two writes of the file by a running writer (milliseconds).
pub const EVERY_MS: u64 = 2000;

/// Most bytes of `STATS` a maintenance open reads (the writer's file is well under 2 KiB).
const MAX_BYTES: u64 = 64 << 10;

/// When the writer opened and last wrote its counters.
pub(in crate::store) struct StatsFile {
    opened_ms: u64,
    pub(in crate::store) written_ms: AtomicU64,
    /// A maintenance open: the numbers `STATS` held when it opened (none without a readable file), which
    /// its own writes keep.
    saved: Option<Vec<(String, u64)>>,
}

impl Default for StatsFile {
    fn default() -> Self {
        Self::new(None)
    }
}

impl StatsFile {
    /// `saved`: a maintenance open's [`load`]ed `STATS`.
    pub(in crate::store) fn new(saved: Option<Vec<(String, u64)>>) -> Self {
        let now = now_ms();
        Self {
            opened_ms: now,
            written_ms: AtomicU64::new(now),
            saved,
        }
    }

    /// The value of `key` a maintenance open loaded.
    fn saved(&self, key: &str) -> Option<u64> {
        let saved = self.saved.as_deref()?;
        saved.iter().find(|f| f.0 == key).map(|f| f.1)
    }
}

/// The numbers of the `STATS` file in `dir` (a flat JSON object of them, as [`Shared::stats_json`] writes
/// it); none when it is missing, not a regular file, not that object, or of another format.
pub(in crate::store) fn load(dir: &Path) -> Vec<(String, u64)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut text = String::new();
    let read = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(dir.join(STATS_FILE))
        .and_then(|f| {
            if !f.metadata()?.is_file() {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            f.take(MAX_BYTES).read_to_string(&mut text)
        });
    let body = text
        .trim()
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'));
    let (Ok(_), Some(body)) = (read, body) else {
        return Vec::new();
    };
    let fields: Option<Vec<(String, u64)>> = body
        .split(',')
        .map(|f| {
            let (k, v) = f.split_once(':')?;
            let k = k.trim().strip_prefix('"')?.strip_suffix('"')?;
            Some((k.to_owned(), v.trim().parse().ok()?))
        })
        .collect();
    match fields {
        Some(f) if f.iter().any(|(k, v)| k == "format" && *v == 1) => f,
        _ => Vec::new(),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Shared {
    /// Writes `STATS` if the last write is [`EVERY_MS`] old (or `now`); a failed write is ignored (the file
    /// keeps its last content). Writable stores only.
    pub(in crate::store) fn persist_stats(&self, now: bool) {
        if self.read_only {
            return;
        }
        let t = now_ms();
        let last = self.stats_file.written_ms.load(Relaxed);
        if !now
            && (t < last + EVERY_MS
                || self
                    .stats_file
                    .written_ms
                    .compare_exchange(last, t, Relaxed, Relaxed)
                    .is_err())
        {
            return;
        }
        self.stats_file.written_ms.store(t, Relaxed);
        let body = self.stats_json(t);
        let file = self.dir.join(STATS_FILE);
        if now {
            let _ = crate::store::space::disk::replace_unsynced(&file, &body);
        } else {
            self.worker.write_stats(file, body);
        }
    }

    /// The counters as the JSON object `STATS` holds. A maintenance open's keep what it loaded: the pid,
    /// the open time and the capacity of the writer that counted, and each counter with this store's own
    /// added (`dropped_records`, which each open counts again, the larger of the two); what is on disk
    /// (objects, bytes, budget) is as it is now, and `maintained_unix_ms` says when it was written.
    pub fn stats_json(&self, written_ms: u64) -> String {
        let (objects, used) = self.usage();
        let (data, journal) = self.occupancy();
        let (budget, claimed) = self.budget().unwrap_or((0, 0));
        let sf = &self.stats_file;
        let maintenance = sf.saved.is_some();
        let capacity = if maintenance {
            sf.saved("capacity_bytes") // a capacity this store was not given is not reported
        } else {
            Some(self.capacity())
        };
        let mut fields: Vec<(&str, u64)> = vec![
            ("format", 1),
            (
                "pid",
                sf.saved("pid").unwrap_or(u64::from(std::process::id())),
            ),
            (
                "opened_unix_ms",
                sf.saved("opened_unix_ms").unwrap_or(sf.opened_ms),
            ),
            ("written_unix_ms", written_ms),
        ];
        fields.extend(capacity.map(|c| ("capacity_bytes", c)));
        fields.extend([
            ("budget_bytes", budget),
            ("claimed_bytes", claimed),
            ("objects", objects as u64),
            ("bytes_used", used),
            ("data_bytes_held", data),
            ("journal_bytes_held", journal),
        ]);
        fields.extend(self.stats.counters().into_iter().map(|(k, v)| {
            let old = sf.saved(k).unwrap_or(0);
            (
                k,
                if k == "dropped_records" {
                    v.max(old)
                } else {
                    v.saturating_add(old)
                },
            )
        }));
        if maintenance {
            fields.push(("maintained_unix_ms", written_ms));
        }
        let body: Vec<String> = fields
            .iter()
            .map(|(k, v)| format!("\"{k}\": {v}"))
            .collect();
        format!("{{{}}}\n", body.join(", "))
    }
}

impl Drop for PageStore {
    fn drop(&mut self) {
        // the background thread's last jobs first (an older STATS must not land over the last one)
        self.worker.finish();
        self.persist_stats(true);
    }
}

//! The writer's counters on disk: `STATS` in the namespace directory, a JSON object rewritten atomically (a
//! temporary file renamed over it) after a batch at most every [`EVERY_MS`] and when the store closes, so
//! `kvtier stats` can show a live or a finished writer's traffic (docs/STORE.md, "Counters on disk"). Not
//! synced: the counters are advice, and a crash costs at most the last few seconds of them. A running
//! writer's rewrites are done by its background thread (`worker`), off the put path; the last one, at
//! close, after that thread has stopped.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{PageStore, Shared};

/// The file's name in the namespace directory.
pub const STATS_FILE: &str = "STATS";
/// Least time between two writes of the file by a running writer (milliseconds).
pub const EVERY_MS: u64 = 2000;

/// When the writer opened and last wrote its counters.
pub(super) struct StatsFile {
    opened_ms: u64,
    pub(super) written_ms: AtomicU64,
}

impl Default for StatsFile {
    fn default() -> Self {
        let now = now_ms();
        Self {
            opened_ms: now,
            written_ms: AtomicU64::new(now),
        }
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
    pub(super) fn persist_stats(&self, now: bool) {
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
        if now {
            let _ = write(&self.dir, &body);
        } else {
            let dir = self.dir.clone();
            self.worker.run(super::worker::Job::Stats { dir, body });
        }
    }

    /// The counters as the JSON object `STATS` holds.
    pub fn stats_json(&self, written_ms: u64) -> String {
        let (objects, used) = self.usage();
        let (data, journal) = self.occupancy();
        let (budget, claimed) = self.budget().unwrap_or((0, 0));
        let mut fields: Vec<(&str, u64)> = vec![
            ("format", 1),
            ("pid", u64::from(std::process::id())),
            ("opened_unix_ms", self.stats_file.opened_ms),
            ("written_unix_ms", written_ms),
            ("capacity_bytes", self.capacity()),
            ("budget_bytes", budget),
            ("claimed_bytes", claimed),
            ("objects", objects as u64),
            ("bytes_used", used),
            ("data_bytes_held", data),
            ("journal_bytes_held", journal),
        ];
        fields.extend(self.stats.counters());
        let body: Vec<String> = fields
            .iter()
            .map(|(k, v)| format!("\"{k}\": {v}"))
            .collect();
        format!("{{{}}}\n", body.join(", "))
    }
}

/// Writes `body` to `STATS` in `dir`: a temporary file renamed over it.
pub(super) fn write(dir: &Path, body: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!("{STATS_FILE}.tmp.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let r = (|| {
        let f = super::namespace::open_rw(&tmp, libc::O_NOFOLLOW | libc::O_EXCL)?;
        std::os::unix::fs::FileExt::write_all_at(&f, body.as_bytes(), 0)?;
        std::fs::rename(&tmp, dir.join(STATS_FILE))
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

impl Drop for PageStore {
    fn drop(&mut self) {
        // the background thread's last jobs first (an older STATS must not land over the last one)
        self.worker.finish();
        self.persist_stats(true);
    }
}

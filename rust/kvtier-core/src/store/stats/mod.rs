//! Counters of a running store and the report of what its open found.

pub(super) mod file;

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

thread_local! {
    /// Set on the background thread (and while one of its jobs runs in the caller; `worker` sets it):
    /// phases are counted as the background's, and a job handed over from a job runs at once, in order.
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is running a background job.
pub(super) fn on_worker() -> bool {
    ON_WORKER.with(|w| w.get())
}

/// Marks this thread as running a background job or not; returns what it was.
pub(super) fn set_on_worker(on: bool) -> bool {
    ON_WORKER.with(|w| w.replace(on))
}

/// Counters a store keeps (`stats`, read through a [`PageStore`](crate::store::PageStore)).
#[derive(Debug, Default)]
pub struct Stats {
    /// Objects written (acknowledged).
    pub puts: AtomicU64,
    /// Bytes written (acknowledged objects, as stored: coded objects' coded bytes).
    pub bytes_written: AtomicU64,
    /// What the acknowledged objects written hold (coded objects' decoded length): with `bytes_written`,
    /// the ratio the codec achieved on the writes.
    pub raw_bytes_written: AtomicU64,
    /// Bytes of objects handed to the codec (those not stored already).
    pub encode_input_bytes: AtomicU64,
    /// Of those, the bytes of the objects stored coded, and their coded bytes.
    pub encoded_raw_bytes: AtomicU64,
    /// Coded bytes of the objects stored coded.
    pub encoded_bytes: AtomicU64,
    /// Nanoseconds put batches spent coding (wall, the batch's threads together).
    pub encode_ns: AtomicU64,
    /// Coded objects read, decoded and verified: their decoded bytes ...
    pub decoded_bytes: AtomicU64,
    /// ... their coded bytes ...
    pub decoded_coded_bytes: AtomicU64,
    /// ... and the nanoseconds their decoding took, summed over the threads that did it.
    pub decode_ns: AtomicU64,
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
    /// Reads whose checksum did not match (object dropped, or marked bad when the drop could not be logged).
    pub corrupt_reads: AtomicU64,
    /// Objects whose write failed (IO error, ENOSPC, capacity, journal).
    pub write_failures: AtomicU64,
    /// Reads that failed with an IO error.
    pub read_failures: AtomicU64,
    /// Journal records dropped at open because they named no bytes the store could have written (an
    /// object past its class file's end, a length outside its class).
    pub dropped_records: AtomicU64,
    /// Journal appends that failed (every object or key of that commit failed with it).
    pub journal_failures: AtomicU64,
    /// Free slots whose blocks were given back to the file system.
    pub punched_slots: AtomicU64,
    /// Journal compactions done since open (the one at open included).
    pub compactions: AtomicU64,
    /// Progress of the running (or last) `verify`: objects checked so far ...
    pub verify_done: AtomicU64,
    /// ... and how many it will check.
    pub verify_total: AtomicU64,
    /// Nanoseconds of put batches by phase, named by [`PUT_PHASES`] (`reserve` includes `evict` (which includes `evict_append`), `punch` and `victims`, `compact_step` includes `compact_finish`, which includes `compact_sync` and `dir_sync`).
    pub put_phase_ns: [AtomicU64; PUT_PHASES.len()],
    /// Nanoseconds of the writer's background thread by the same phases: the compaction steps it runs
    /// (`compact_step`, `compact_finish`, `compact_sync`, `dir_sync`) and the replaced journals it closes
    /// (`journal_close`), none of which a put batch waits for.
    pub background_phase_ns: [AtomicU64; PUT_PHASES.len()],
}

/// The phases of a put batch (docs/STORE.md, "put"), as `put_phase_ns` counts them.
pub const PUT_PHASES: [&str; 21] = [
    "validate",
    "keep_to_limit",
    "reserve",
    "evict",
    "allocate",
    "write",
    "data_sync",
    "journal_reserve",
    "journal_append",
    "index_insert",
    "compact_step",
    "settle",
    "stats_file",
    "compact_finish",
    "punch",
    "victims",
    "compact_sync",
    "dir_sync",
    "evict_append",
    "journal_close",
    "encode",
];

/// Phase indices into `put_phase_ns`.
pub(crate) mod phase {
    pub const VALIDATE: usize = 0;
    pub const KEEP: usize = 1;
    pub const RESERVE: usize = 2;
    pub const EVICT: usize = 3;
    pub const ALLOCATE: usize = 4;
    pub const WRITE: usize = 5;
    pub const DATA_SYNC: usize = 6;
    pub const JOURNAL_RESERVE: usize = 7;
    pub const JOURNAL_APPEND: usize = 8;
    pub const INDEX_INSERT: usize = 9;
    pub const COMPACT: usize = 10;
    pub const SETTLE: usize = 11;
    pub const STATS_FILE: usize = 12;
    /// Part of `COMPACT` (or of an open's compaction): the finish under the commit lock.
    pub const COMPACT_FINISH: usize = 13;
    /// Part of `RESERVE`: giving free slots' blocks back (`fallocate` punches).
    pub const PUNCH: usize = 14;
    /// Part of `RESERVE`: choosing the eviction's victims.
    pub const VICTIMS: usize = 15;
    /// Part of `COMPACT_FINISH`: the new journal's reserve and sync.
    pub const COMPACT_SYNC: usize = 16;
    /// Part of `COMPACT_FINISH`: the rename and the directory's sync.
    pub const DIR_SYNC: usize = 17;
    /// Part of `EVICT`: the del records' append and sync.
    pub const EVICT_APPEND: usize = 18;
    /// Background: closing a replaced journal (its blocks given back a piece at a time, each synced).
    pub const JOURNAL_CLOSE: usize = 19;
    /// Coding the batch's objects (a store with a codec).
    pub const ENCODE: usize = 20;
}

impl Stats {
    /// The traffic and failure counters by name (the verify progress left out).
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        [
            ("puts", &self.puts),
            ("bytes_written", &self.bytes_written),
            ("raw_bytes_written", &self.raw_bytes_written),
            ("encode_input_bytes", &self.encode_input_bytes),
            ("encoded_raw_bytes", &self.encoded_raw_bytes),
            ("encoded_bytes", &self.encoded_bytes),
            ("encode_ns", &self.encode_ns),
            ("decoded_bytes", &self.decoded_bytes),
            ("decoded_coded_bytes", &self.decoded_coded_bytes),
            ("decode_ns", &self.decode_ns),
            ("put_ns", &self.put_ns),
            ("hits", &self.hits),
            ("misses", &self.misses),
            ("bytes_read", &self.bytes_read),
            ("get_ns", &self.get_ns),
            ("evictions", &self.evictions),
            ("corrupt_reads", &self.corrupt_reads),
            ("write_failures", &self.write_failures),
            ("read_failures", &self.read_failures),
            ("journal_failures", &self.journal_failures),
            ("punched_slots", &self.punched_slots),
            ("compactions", &self.compactions),
            ("dropped_records", &self.dropped_records),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.load(Relaxed)))
        .collect()
    }

    /// Adds the time since `*t` to phase `p` (of the background thread's phases on that thread) and
    /// restarts `*t`.
    pub(crate) fn lap(&self, p: usize, t: &mut std::time::Instant) {
        let now = std::time::Instant::now();
        let phases = if on_worker() {
            &self.background_phase_ns
        } else {
            &self.put_phase_ns
        };
        phases[p].fetch_add((now - *t).as_nanos() as u64, Relaxed);
        *t = now;
    }

    /// Put time by phase: `(name, nanoseconds)`.
    pub fn put_phases(&self) -> Vec<(&'static str, u64)> {
        PUT_PHASES
            .iter()
            .zip(&self.put_phase_ns)
            .map(|(k, v)| (*k, v.load(Relaxed)))
            .collect()
    }

    /// The background thread's time by phase: `(name, nanoseconds)`.
    pub fn background_phases(&self) -> Vec<(&'static str, u64)> {
        PUT_PHASES
            .iter()
            .zip(&self.background_phase_ns)
            .map(|(k, v)| (*k, v.load(Relaxed)))
            .collect()
    }
}

/// What opening the store found on disk (fixed for the life of the open store).
#[derive(Clone, Debug, Default)]
pub struct OpenReport {
    /// Bytes of a torn journal tail: cut by a writable open, only reported by a read-only one.
    pub torn_tail: u64,
    /// Damaged spans between valid journal records, skipped.
    pub damaged_spans: u64,
    /// Bytes in those spans.
    pub damaged_bytes: u64,
    /// Journal records dropped because they named no bytes the store could have written.
    pub dropped_records: u64,
    /// Size classes that journal records name but whose data file is missing.
    pub missing_class_files: Vec<u32>,
    /// Put records resolved by replay's slot rule (an earlier key whose slot a later record took).
    pub superseded_by_slot: u64,
    /// Set when the journal's delete reserve could not be established (a full disk at open): puts fail
    /// until it can be.
    pub reserve_note: Option<String>,
    /// Whether the journal was compacted at open.
    pub compacted: bool,
    /// Where the open's time went, in order: `(phase, nanoseconds)` — reading the journal (`read`),
    /// parsing it (`parse`), replaying its records (`replay`), building the index of the live keys from
    /// that (`index_build`), trimming the data files (`trim`), and (writable) what follows (`after_open`:
    /// a compaction if due, the reserve, eviction to the capacity).
    pub open_phase_ns: Vec<(&'static str, u64)>,
}

impl OpenReport {
    /// Whether open found damage that `verify --repair` would remove (a torn tail a writable open already
    /// cut is not damage any more).
    pub fn damaged(&self, read_only: bool) -> bool {
        self.damaged_spans > 0
            || self.dropped_records > 0
            || !self.missing_class_files.is_empty()
            || (read_only && self.torn_tail > 0)
    }
}

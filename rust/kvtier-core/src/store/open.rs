//! Opening a namespace: the options checked, the directory locked (or looked at read-only), O_DIRECT
//! probed, the journal read, its torn tail cut and its records replayed into the index.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::io::seal_io;
use super::log::commit::JournalFile;
use super::log::locks::Log;
use super::log::{follow, recovery};
use super::space::{budget, files};
use super::stats::file as stats_file;
use super::{
    format, index, io_err, journal, namespace, namespace_dir, OpenReport, PageStore, Shared, Stats,
    StoreOptions, ALIGN,
};
use crate::error::{Error, Result};

/// How [`PageStore::open_impl`] opens a namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Without writing anything ([`PageStore::open_read_only`]).
    ReadOnly,
    /// For reading and writing, by the namespace's engine ([`PageStore::open`]).
    Writable,
    /// For reading and writing by a maintenance command ([`PageStore::open_maintenance`]): the counters
    /// and the capacity in `STATS` are kept.
    Maintenance,
}

impl PageStore {
    pub(super) fn open_impl(
        root: &Path,
        namespace: &str,
        mut opts: StoreOptions,
        mode: Mode,
    ) -> Result<Self> {
        let writable = mode != Mode::ReadOnly;
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
        if let Some(b @ 1..ALIGN) = opts.budget_bytes {
            return Err(Error::arg(
                "budget_bytes",
                format!("must be 0 (no budget) or >= {ALIGN}, got {b}"),
            ));
        }
        // the store allocates whole 4 KiB blocks: a capacity between two multiples is the lower one
        opts.capacity_bytes = opts.capacity_bytes / ALIGN * ALIGN;
        let (dir, lock, live_writer) = if writable {
            let (d, l) = namespace::open_writable(root, namespace)?;
            (d, Some(l), false)
        } else {
            let (d, live) = namespace::open_read_only(root, namespace)?;
            (d, None, live)
        };
        format::check(&dir, root, writable)?;
        // read under the LOCK: no writer rewrites it from here on
        let saved = (mode == Mode::Maintenance).then(|| stats_file::load(&dir));
        let share = if writable {
            let name = namespace_dir(namespace);
            Some(budget::Share::open(root, &name, opts.budget_bytes)?)
        } else {
            None
        };
        let (direct, direct_note) = match (writable, opts.direct) {
            (false, _) => (false, None),
            (true, Some(false)) => (
                false,
                Some("O_DIRECT disabled by the caller; using buffered IO".to_owned()),
            ),
            (true, want) => match files::probe_direct(&dir) {
                Ok(None) => (true, None),
                Ok(Some(e)) if want == Some(true) => {
                    return Err(Error::Os {
                        what: format!("O_DIRECT required but refused here: {e}"),
                        source: std::io::Error::from_raw_os_error(libc::EINVAL),
                    })
                }
                Ok(Some(e)) => (
                    false,
                    Some(format!(
                        "the file system refused O_DIRECT ({e}); using buffered IO with fdatasync"
                    )),
                ),
                // not a verdict on O_DIRECT: keep it (each IO falls back to buffered on EINVAL)
                Err(e) => (
                    true,
                    Some(format!(
                        "the O_DIRECT probe could not write ({e}); O_DIRECT kept"
                    )),
                ),
            },
        };
        let jpath = dir.join("journal.log");
        if writable {
            let _ = std::fs::remove_file(dir.join("journal.compact")); // an interrupted compaction
        }
        let journal = match JournalFile::open(&jpath, writable, opts.capacity_bytes) {
            Ok(j) => j,
            Err(e) if !writable && e.kind() == std::io::ErrorKind::NotFound => {
                return Err(io_err(format!("no journal in {}", dir.display()), e))
            }
            Err(e) => return Err(io_err("opening journal.log", e)),
        };
        let mut t = std::time::Instant::now();
        let mut phases: Vec<(&'static str, u64)> = Vec::new();
        let lap = |phases: &mut Vec<_>, name: &'static str, t: &mut std::time::Instant| {
            phases.push((name, t.elapsed().as_nanos() as u64));
            *t = std::time::Instant::now();
        };
        let mut bytes = Vec::new();
        (&journal.file)
            .read_to_end(&mut bytes)
            .map_err(|e| io_err("reading journal.log", e))?;
        lap(&mut phases, "read", &mut t);
        let parsed = journal::parse_resync_with(&bytes, recovery::Rec::of);
        lap(&mut phases, "parse", &mut t);
        let follow = (!writable)
            .then(|| {
                use std::os::unix::fs::MetadataExt;
                let md = journal
                    .file
                    .metadata()
                    .map_err(|e| io_err("stat journal.log", e))?;
                Ok::<_, Error>(follow::Follow::new(
                    (md.dev(), md.ino()),
                    parsed.valid_end as u64,
                ))
            })
            .transpose()?;
        let mut report = OpenReport {
            torn_tail: (bytes.len() - parsed.valid_end) as u64,
            damaged_spans: parsed.damaged.len() as u64,
            damaged_bytes: parsed.damaged_bytes() as u64,
            ..Default::default()
        };
        if writable && parsed.valid_end < bytes.len() {
            journal
                .file
                .set_len(parsed.valid_end as u64)
                .and_then(|()| journal.file.sync_all())
                .map_err(|e| io_err("cutting a torn journal tail", e))?;
        }
        let (mut index, forgotten) = recovery::replay(
            &dir,
            &bytes,
            parsed.records,
            &mut report,
            if writable {
                index::presize(opts.capacity_bytes)
            } else {
                0
            },
        )?;
        // (replay counted `index_build`, its last part, itself)
        let index_build = report.open_phase_ns.pop().map_or(0, |p| p.1);
        lap(&mut phases, "replay", &mut t);
        if let Some(p) = phases.last_mut() {
            p.1 -= index_build.min(p.1);
        }
        phases.push(("index_build", index_build));
        let punch_ok = recovery::trim_data_files(&dir, &mut index, writable);
        lap(&mut phases, "trim", &mut t);
        index.j_end = if writable {
            parsed.valid_end as u64
        } else {
            bytes.len() as u64
        };
        // what the journal holds on disk, its earlier reserve past the end included (kept, not given up:
        // another process could take that space before the reserve is established again)
        let held = files::extent_bytes(&journal.file).div_ceil(ALIGN) * ALIGN;
        index.j_alloc = (index.j_end.div_ceil(ALIGN) * ALIGN).max(if writable { held } else { 0 });
        index.compact_floor = journal.compact_base;
        let store = Shared {
            me: std::sync::Weak::new(),
            step_queued: AtomicBool::new(false),
            dir,
            namespace: namespace.to_owned(),
            opts,
            direct,
            direct_note,
            read_only: !writable,
            live_writer,
            _lock: lock,
            log: Log::new(index, journal, follow),
            classes: Mutex::new(HashMap::new()),
            alloc_lock: Mutex::new(()),
            punch_ok: AtomicBool::new(punch_ok),
            scratch: seal_io::ScratchPool::default(),
            poisoned: AtomicBool::new(false),
            pages: Default::default(),
            memory: Default::default(),
            share,
            stats_file: stats_file::StatsFile::new(saved),
            worker: Default::default(),
            erased: Default::default(),
            stats: Stats::default(),
        };
        store
            .stats
            .dropped_records
            .store(report.dropped_records, Ordering::Relaxed);
        report.open_phase_ns.splice(0..0, phases);
        let mut store = PageStore {
            inner: std::sync::Arc::new_cyclic(|me| Shared {
                me: me.clone(),
                ..store
            }),
            report,
        };
        if writable {
            let (compacted, note) = store.after_open(forgotten);
            let after = ("after_open", t.elapsed().as_nanos() as u64);
            store.report.open_phase_ns.push(after);
            store.report.compacted = compacted;
            store.report.reserve_note = note;
        }
        Ok(store)
    }
}

//! The page store's counters as a dict, and the store-related free functions of `kvtier._native`
//! (namespace names, page hashes, the disk roofline, fault injection).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_core::store::PageStore;
use kvtier_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::KvResult;

/// `PageStore.verify(repair)`: `{"checked", "corrupt", "unreadable"}`, the GIL released while it runs.
pub fn verify<'py>(
    py: Python<'py>,
    s: &std::sync::Arc<PageStore>,
    repair: bool,
) -> KvResult<Bound<'py, PyDict>> {
    let r = crate::exit::detach_io(py, || s.verify(repair))?;
    let d = PyDict::new(py);
    d.set_item("checked", r.checked)?;
    d.set_item("corrupt", r.corrupt)?;
    d.set_item("unreadable", r.unreadable)?;
    Ok(d)
}

/// `PageStore.verify_progress()`: `(checked, total)` of the running (or last) `verify`.
pub fn verify_progress(s: &PageStore) -> (u64, u64) {
    (
        s.stats.verify_done.load(Ordering::Relaxed),
        s.stats.verify_total.load(Ordering::Relaxed),
    )
}

/// `PageStore.stats()`: counters, occupancy and what open found.
pub fn stats<'py>(py: Python<'py>, s: &PageStore) -> KvResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let st = &s.stats;
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (objects, used) = s.usage();
    let (data, journal) = s.occupancy();
    let rep = s.open_report();
    let (coded_objects, stored_bytes, content_bytes) = s.content();
    for (k, v) in [
        ("puts", ld(&st.puts)),
        ("bytes_written", ld(&st.bytes_written)),
        ("raw_bytes_written", ld(&st.raw_bytes_written)),
        ("encode_input_bytes", ld(&st.encode_input_bytes)),
        ("encoded_raw_bytes", ld(&st.encoded_raw_bytes)),
        ("encoded_bytes", ld(&st.encoded_bytes)),
        ("encode_ns", ld(&st.encode_ns)),
        ("decoded_bytes", ld(&st.decoded_bytes)),
        ("decoded_coded_bytes", ld(&st.decoded_coded_bytes)),
        ("decode_ns", ld(&st.decode_ns)),
        ("coded_objects", coded_objects as u64),
        ("stored_bytes", stored_bytes),
        ("content_bytes", content_bytes),
        ("put_ns", ld(&st.put_ns)),
        ("hits", ld(&st.hits)),
        ("misses", ld(&st.misses)),
        ("bytes_read", ld(&st.bytes_read)),
        ("get_ns", ld(&st.get_ns)),
        ("evictions", ld(&st.evictions)),
        ("corrupt_reads", ld(&st.corrupt_reads)),
        ("write_failures", ld(&st.write_failures)),
        ("read_failures", ld(&st.read_failures)),
        ("journal_failures", ld(&st.journal_failures)),
        ("punched_slots", ld(&st.punched_slots)),
        ("compactions", ld(&st.compactions)),
        ("dropped_records", ld(&st.dropped_records)),
        ("objects", objects as u64),
        ("bytes_used", used),
        ("data_bytes_held", data),
        ("journal_bytes_held", journal),
        ("capacity_bytes", s.capacity()),
        ("recovered_tail_bytes", rep.torn_tail),
        ("journal_damaged_spans", rep.damaged_spans),
        ("journal_damaged_bytes", rep.damaged_bytes),
        ("superseded_by_slot", rep.superseded_by_slot),
    ] {
        d.set_item(k, v)?;
    }
    let (budget, claimed) = s.budget().unzip();
    d.set_item("budget_bytes", budget)?;
    d.set_item("budget_claimed_bytes", claimed)?;
    d.set_item("missing_class_files", rep.missing_class_files.clone())?;
    d.set_item("reserve_note", rep.reserve_note.clone())?;
    d.set_item("compacted_at_open", rep.compacted)?;
    d.set_item("damaged", rep.damaged(s.read_only()))?;
    d.set_item("read_only", s.read_only())?;
    d.set_item("live_writer", s.live_writer())?;
    d.set_item("poisoned", s.poisoned())?;
    d.set_item("o_direct", s.direct())?;
    d.set_item("o_direct_note", s.direct_note())?;
    d.set_item("dir", s.dir().to_string_lossy().to_string())?;
    d.set_item("namespace", s.namespace())?;
    d.set_item("codec", s.codec().map(|c| c.name()))?;
    Ok(d)
}

/// The namespace directory name for a namespace string.
#[pyfunction]
pub fn namespace_dir(namespace: &str) -> String {
    kvtier_core::store::namespace_dir(namespace)
}

/// SGLang-compatible chained SHA-256 page keys of `token_ids`, `page_size` tokens a page (full pages only).
#[pyfunction]
#[pyo3(signature = (token_ids, page_size, prior_hash=None))]
pub fn page_hashes(
    py: Python<'_>,
    token_ids: Vec<u32>,
    page_size: usize,
    prior_hash: Option<String>,
) -> KvResult<Vec<String>> {
    Ok(crate::exit::detach_io(py, || {
        kvtier_core::hash::page_hashes(&token_ids, page_size, prior_hash.as_deref())
    })?)
}

/// The disk's O_DIRECT ceiling for `count` objects of `size` bytes with `threads` in flight, measured in
/// `dir`: `(write GB/s durable, read GB/s, O_DIRECT used)`.
#[pyfunction]
pub fn disk_roofline(
    py: Python<'_>,
    dir: PathBuf,
    size: usize,
    count: usize,
    threads: usize,
) -> KvResult<(f64, f64, bool)> {
    Ok(crate::exit::detach_io(py, || {
        kvtier_core::roofline::odirect_roofline(&dir, size, count, threads)
    })?)
}

/// Injects a fault into the page store's IO point `point` (see `kvtier.testing.inject_fault`): `kind` is
/// "error", "delay", "short" or "torn"; the next `times` calls after `skip` are hit.
#[pyfunction]
#[pyo3(signature = (point, kind, skip=0, times=1, errno=5, delay_ms=0))]
pub fn fault_set(
    point: &str,
    kind: &str,
    skip: u64,
    times: u64,
    errno: i32,
    delay_ms: u64,
) -> KvResult<()> {
    use kvtier_core::fault::{Fault, POINTS};
    if !POINTS.contains(&point) {
        return Err(
            Error::arg("point", format!("must be one of {POINTS:?}, got {point:?}")).into(),
        );
    }
    if errno <= 0 {
        return Err(Error::arg("errno", format!("must be a positive errno, got {errno}")).into());
    }
    let fault = match kind {
        "error" => Fault::Error(errno),
        "delay" => Fault::Delay(std::time::Duration::from_millis(delay_ms)),
        // a hung disk: blocked until the faults are cleared (at most delay_ms; 0: ten minutes)
        "stall" => Fault::Stall(std::time::Duration::from_millis(if delay_ms == 0 {
            600_000
        } else {
            delay_ms
        })),
        "short" if point == "data_write" || point == "journal_write" => Fault::Short(errno),
        "torn" if point == "data_write" => Fault::Torn,
        "short" | "torn" => {
            return Err(Error::arg(
                "kind",
                format!("{kind:?} applies to point \"data_write\" (short: also \"journal_write\"), not {point:?}"),
            )
            .into())
        }
        _ => {
            return Err(Error::arg(
                "kind",
                format!("must be \"error\", \"delay\", \"stall\", \"short\" or \"torn\", got {kind:?}"),
            )
            .into())
        }
    };
    kvtier_core::fault::set(point, skip, times, fault);
    Ok(())
}

/// The IO points faults can be injected at.
#[pyfunction]
pub fn fault_points() -> Vec<&'static str> {
    kvtier_core::fault::POINTS.to_vec()
}

/// Removes every injected fault.
#[pyfunction]
pub fn fault_clear() {
    kvtier_core::fault::clear()
}

/// Faults `point` has delivered since it was set.
#[pyfunction]
pub fn fault_hits(point: &str) -> u64 {
    kvtier_core::fault::hits(point)
}

/// `(budget or None, [dict])`: a store directory's namespace directories (`dir`, `namespace`,
/// `disk_bytes`, `last_write_unix`, `live`, `claimed_bytes`, `pid`), read-only.
#[pyfunction]
pub fn store_namespaces<'py>(
    py: Python<'py>,
    root: PathBuf,
) -> KvResult<(Option<u64>, Vec<Bound<'py, PyDict>>)> {
    let (budget, list) =
        crate::exit::detach_io(py, || kvtier_core::store::lifecycle::namespaces(&root))?;
    let mut out = Vec::with_capacity(list.len());
    for e in list {
        let d = PyDict::new(py);
        d.set_item("dir", e.dir)?;
        d.set_item("namespace", e.namespace)?;
        d.set_item("disk_bytes", e.disk_bytes)?;
        d.set_item("last_write_unix", e.last_write_unix)?;
        d.set_item("live", e.live)?;
        d.set_item("claimed_bytes", e.claim.map(|c| c.0))?;
        d.set_item("pid", e.claim.map(|c| c.1).filter(|&p| p > 0))?;
        out.push(d);
    }
    Ok((budget, out))
}

/// Removes namespace directory `dir` of the store at `root` (refused while a live process holds its LOCK,
/// unless `force`); returns the bytes its files held.
#[pyfunction]
#[pyo3(signature = (root, dir, force=false))]
pub fn remove_namespace(py: Python<'_>, root: PathBuf, dir: String, force: bool) -> KvResult<u64> {
    Ok(crate::exit::detach_io(py, || {
        kvtier_core::store::lifecycle::remove_namespace(&root, &dir, force)
    })?)
}

/// The budget of the store at `root` (None: none).
#[pyfunction]
pub fn store_budget(root: PathBuf) -> KvResult<Option<u64>> {
    Ok(kvtier_core::store::lifecycle::budget(&root)?)
}

/// Sets (None: removes) the budget of the existing store at `root`.
#[pyfunction]
pub fn set_store_budget(root: PathBuf, bytes: Option<u64>) -> KvResult<()> {
    Ok(kvtier_core::store::lifecycle::set_budget(&root, bytes)?)
}

/// The on-disk format this kvtier reads and writes.
#[pyfunction]
pub fn store_format_version() -> u32 {
    kvtier_core::store::format::FORMAT_VERSION
}

//! `kvtier._native.PageStore`: the binding of `kvtier_core::store::PageStore`, plus `page_hashes`.
//!
//! Objects are given as `(key, address, length)`; every range must lie inside a host region registered
//! with the store (the store holds those regions alive), and a batch's destination ranges must not
//! overlap, so no raw pointer from Python reaches the IO without being proven in bounds.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, RwLock};

use kvtier_core::buffer::HostRegion;
use kvtier_core::store::{PageStore, StoreOptions};
use kvtier_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffer::PyHostRegion;
use crate::errors::KvResult;

/// Memory the store may read and write: a Rust-owned region, or a torch tensor's storage (an engine's own
/// host pool), kept alive by a reference to its owner.
#[derive(Clone)]
enum Region {
    Rust(Arc<HostRegion>),
    Foreign {
        ptr: usize,
        len: usize,
        _owner: Arc<Py<PyAny>>,
    },
}

impl Region {
    fn range(&self) -> (usize, usize) {
        match self {
            Region::Rust(r) => (r.as_ptr() as usize, r.len()),
            Region::Foreign { ptr, len, .. } => (*ptr, *len),
        }
    }
}

/// A page store namespace (see kvtier.PageStore for the public API).
#[pyclass(name = "PageStore", module = "kvtier._native", frozen)]
pub struct PyPageStore {
    inner: RwLock<Option<Arc<PageStore>>>,
    regions: Mutex<Vec<Region>>,
    /// Host ranges of the batches in flight, so that batches from several threads never write memory
    /// another batch reads or writes (a `get` writes its destinations, a `put` reads its sources).
    busy: Mutex<Busy>,
    idle: Condvar,
}

/// `(start, len)` host ranges of one batch, sorted by start.
type Ranges = Vec<(usize, usize)>;

#[derive(Default)]
struct Busy {
    next: u64,
    /// (batch id, whether it writes host memory, its ranges)
    batches: Vec<(u64, bool, Ranges)>,
}

/// Whether two start-sorted lists of `(start, len)` ranges share a byte.
fn overlap(a: &[(usize, usize)], b: &[(usize, usize)]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        if x.0 < y.0.saturating_add(y.1) && y.0 < x.0.saturating_add(x.1) {
            return true;
        }
        if x.0.saturating_add(x.1) <= y.0.saturating_add(y.1) {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

/// A batch's claim on its host ranges; released on drop.
struct Claim<'a> {
    store: &'a PyPageStore,
    id: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut b = self.store.busy.lock().unwrap_or_else(|p| p.into_inner());
        b.batches.retain(|(id, _, _)| *id != self.id);
        self.store.idle.notify_all();
    }
}

impl PyPageStore {
    /// Waits until no batch in flight conflicts with `ranges` (a writer conflicts with any overlap, readers
    /// only with writers), then claims them. Call with the GIL released: the batch it waits for needs the
    /// GIL to return. Each batch claims all its ranges at once, so claims cannot deadlock.
    fn claim(&self, ptrs: &[usize], sizes: &[u64], writes: bool) -> Claim<'_> {
        let mut ranges: Vec<(usize, usize)> = ptrs
            .iter()
            .zip(sizes)
            .map(|(&p, &n)| (p, usize::try_from(n).unwrap_or(usize::MAX)))
            .collect();
        ranges.sort_unstable();
        let mut b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        while b
            .batches
            .iter()
            .any(|(_, w, rs)| (*w || writes) && overlap(rs, &ranges))
        {
            b = self.idle.wait(b).unwrap_or_else(|p| p.into_inner());
        }
        let id = b.next;
        b.next += 1;
        b.batches.push((id, writes, ranges));
        Claim { store: self, id }
    }

    /// One put (`writes` false: the host ranges are read) or get (`writes` true: they are written) batch:
    /// every range checked against the registered regions (disjoint when written), the regions kept alive,
    /// and the ranges claimed against the other batches in flight, all before a byte moves.
    fn batch(
        &self,
        py: Python<'_>,
        keys: &[String],
        ptrs: &[usize],
        sizes: &[u64],
        writes: bool,
    ) -> KvResult<Vec<bool>> {
        let s = self.store()?;
        let objs = Self::objs(keys, ptrs, sizes)?;
        let _alive = self.check_ranges(ptrs, sizes, writes)?;
        Ok(py.detach(|| {
            let _claim = self.claim(ptrs, sizes, writes);
            // every range lies inside a registered region that `_alive` keeps alive for the call; written
            // ranges do not overlap each other; and while the claim is held no other batch of this store
            // writes a range this one touches, or touches a range this one writes (memory the engine itself
            // writes, e.g. a device -> host backup into the same pages, is the caller's to order).
            if writes {
                // SAFETY: live, disjoint destinations that no other batch of this store touches meanwhile.
                unsafe { s.get(&objs) }
            } else {
                // SAFETY: live sources that no batch of this store writes meanwhile.
                unsafe { s.put(&objs) }
            }
        })?)
    }

    fn store(&self) -> KvResult<Arc<PageStore>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Closed("PageStore").into())
    }

    /// Checks every `(ptr, len)` against the registered regions; with `disjoint`, also that no two overlap.
    fn check_ranges(&self, ptrs: &[usize], sizes: &[u64], disjoint: bool) -> KvResult<Vec<Region>> {
        let regions = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for (i, (&p, &n)) in ptrs.iter().zip(sizes).enumerate() {
            let inside = regions.iter().any(|r| {
                let (b, l) = r.range();
                p >= b && (p as u128 + n as u128) <= (b as u128 + l as u128)
            });
            if !inside {
                return Err(Error::arg(
                    "host_indices",
                    format!(
                        "object {i} ({n} bytes at {p:#x}) is outside every registered host buffer"
                    ),
                )
                .into());
            }
        }
        if disjoint {
            let mut v: Vec<(usize, u64)> =
                ptrs.iter().copied().zip(sizes.iter().copied()).collect();
            v.sort_unstable();
            for w in v.windows(2) {
                if (w[0].0 as u128 + w[0].1 as u128) > w[1].0 as u128 {
                    return Err(Error::arg(
                        "host_indices",
                        "two objects of one batch would be read into overlapping memory",
                    )
                    .into());
                }
            }
        }
        Ok(regions)
    }

    fn objs<'a>(
        keys: &'a [String],
        ptrs: &[usize],
        sizes: &[u64],
    ) -> KvResult<Vec<(&'a str, usize, u64)>> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return Err(Error::arg(
                "keys",
                format!(
                    "{} keys, {} addresses and {} sizes",
                    keys.len(),
                    ptrs.len(),
                    sizes.len()
                ),
            )
            .into());
        }
        Ok(keys
            .iter()
            .zip(ptrs)
            .zip(sizes)
            .map(|((k, &p), &n)| (k.as_str(), p, n))
            .collect())
    }
}

#[pymethods]
impl PyPageStore {
    #[new]
    #[pyo3(signature = (root, namespace, capacity_bytes, io_threads=16, direct=None))]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        namespace: String,
        capacity_bytes: u64,
        io_threads: usize,
        direct: Option<bool>,
    ) -> KvResult<Self> {
        let opts = StoreOptions {
            capacity_bytes,
            io_threads,
            direct,
        };
        let s = py.detach(|| PageStore::open(&root, &namespace, opts))?;
        Ok(Self {
            inner: RwLock::new(Some(Arc::new(s))),
            regions: Mutex::new(Vec::new()),
            busy: Mutex::new(Busy::default()),
            idle: Condvar::new(),
        })
    }

    /// Allows IO into and out of `region` (the store keeps it alive).
    fn register_region(&self, region: &PyHostRegion) -> KvResult<()> {
        let r = region.get()?;
        let mut regs = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        if !regs
            .iter()
            .any(|x| matches!(x, Region::Rust(y) if Arc::ptr_eq(y, &r)))
        {
            regs.push(Region::Rust(r));
        }
        Ok(())
    }

    /// Allows IO into and out of a contiguous CPU tensor's bytes (`tensor.data_ptr()`, `tensor.nbytes`);
    /// the store keeps the tensor alive. For engines whose host pool memory is not kvtier's.
    fn register_tensor(&self, py: Python<'_>, tensor: Bound<'_, PyAny>) -> KvResult<()> {
        let contiguous: bool = tensor.call_method0("is_contiguous")?.extract()?;
        let device: String = tensor.getattr("device")?.getattr("type")?.extract()?;
        if !contiguous || device != "cpu" {
            return Err(Error::arg("pool", format!("host buffers must be contiguous CPU tensors (got device {device:?}, contiguous={contiguous})")).into());
        }
        let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
        let len: usize = tensor.getattr("nbytes")?.extract()?;
        // hold the storage too: `set_()` on the tensor would otherwise free the memory registered here (a
        // reallocating `resize_` of a registered tensor is not covered: registered buffers must not be
        // resized)
        let storage = tensor.call_method0("untyped_storage")?;
        let owner = Arc::new(
            pyo3::types::PyTuple::new(py, [tensor, storage])?
                .into_any()
                .unbind(),
        );
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Region::Foreign {
                ptr,
                len,
                _owner: owner,
            });
        Ok(())
    }

    /// Stores objects; returns per object whether it is durably stored.
    fn put(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<u64>,
    ) -> KvResult<Vec<bool>> {
        self.batch(py, &keys, &ptrs, &sizes, false)
    }

    /// Reads objects into memory; returns per object whether it was found and verified.
    fn get(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<u64>,
    ) -> KvResult<Vec<bool>> {
        self.batch(py, &keys, &ptrs, &sizes, true)
    }

    fn exists(&self, keys: Vec<String>) -> KvResult<Vec<bool>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        Ok(self.store()?.exists(&refs))
    }

    fn delete(&self, py: Python<'_>, keys: Vec<String>) -> KvResult<usize> {
        let s = self.store()?;
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        Ok(py.detach(|| s.delete(&refs))?)
    }

    fn clear(&self, py: Python<'_>) -> KvResult<usize> {
        let s = self.store()?;
        Ok(py.detach(|| s.clear())?)
    }

    /// (objects checked, corrupt keys); with drop=True corrupt objects are deleted.
    fn verify(&self, py: Python<'_>, drop: bool) -> KvResult<(usize, Vec<String>)> {
        let s = self.store()?;
        Ok(py.detach(|| s.verify(drop))?)
    }

    fn keys(&self) -> KvResult<Vec<String>> {
        Ok(self.store()?.keys())
    }

    fn stats<'py>(&self, py: Python<'py>) -> KvResult<Bound<'py, PyDict>> {
        let s = self.store()?;
        let d = PyDict::new(py);
        let st = &s.stats;
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let (objects, used) = s.usage();
        for (k, v) in [
            ("puts", ld(&st.puts)),
            ("bytes_written", ld(&st.bytes_written)),
            ("put_ns", ld(&st.put_ns)),
            ("hits", ld(&st.hits)),
            ("misses", ld(&st.misses)),
            ("bytes_read", ld(&st.bytes_read)),
            ("get_ns", ld(&st.get_ns)),
            ("evictions", ld(&st.evictions)),
            ("corrupt_reads", ld(&st.corrupt_reads)),
            ("write_failures", ld(&st.write_failures)),
            ("read_failures", ld(&st.read_failures)),
            ("dropped_records", ld(&st.dropped_records)),
            ("objects", objects as u64),
            ("bytes_used", used),
            ("capacity_bytes", s.capacity()),
            ("recovered_tail_bytes", s.recovered_tail()),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("o_direct", s.direct())?;
        d.set_item("o_direct_note", s.direct_note())?;
        d.set_item("dir", s.dir().to_string_lossy().to_string())?;
        d.set_item("namespace", s.namespace())?;
        Ok(d)
    }

    #[getter]
    fn dir(&self) -> KvResult<String> {
        Ok(self.store()?.dir().to_string_lossy().to_string())
    }
    #[getter]
    fn direct(&self) -> KvResult<bool> {
        Ok(self.store()?.direct())
    }
    #[getter]
    fn direct_note(&self) -> KvResult<Option<String>> {
        Ok(self.store()?.direct_note().map(str::to_owned))
    }
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// Releases the namespace (and its LOCK) once no call is in flight.
    fn close(&self, py: Python<'_>) {
        let s = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        py.detach(move || drop(s));
    }
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
    Ok(py.detach(|| kvtier_core::hash::page_hashes(&token_ids, page_size, prior_hash.as_deref()))?)
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
    Ok(py.detach(|| kvtier_core::roofline::odirect_roofline(&dir, size, count, threads))?)
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
        "short" if point == "data_write" => Fault::Short(errno),
        "torn" if point == "data_write" => Fault::Torn,
        "short" | "torn" => {
            return Err(Error::arg(
                "kind",
                format!("{kind:?} applies to point \"data_write\" only, not {point:?}"),
            )
            .into())
        }
        _ => {
            return Err(Error::arg(
                "kind",
                format!("must be \"error\", \"delay\", \"short\" or \"torn\", got {kind:?}"),
            )
            .into())
        }
    };
    kvtier_core::fault::set(point, skip, times, fault);
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::overlap;

    /// `overlap` against the quadratic definition, on random small cases (objects are never empty).
    #[test]
    fn overlap_matches_the_definition() {
        let mut rng = 0x2545f4914f6cdd1du64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n) as usize
        };
        for _ in 0..20_000 {
            let mut a: Vec<(usize, usize)> =
                (0..next(4)).map(|_| (next(40), 1 + next(8))).collect();
            let mut b: Vec<(usize, usize)> =
                (0..next(4)).map(|_| (next(40), 1 + next(8))).collect();
            a.sort_unstable();
            b.sort_unstable();
            let want = a
                .iter()
                .any(|x| b.iter().any(|y| x.0 < y.0 + y.1 && y.0 < x.0 + x.1));
            assert_eq!(overlap(&a, &b), want, "{a:?} {b:?}");
        }
    }
}

//! `kvtier._native.PageStore`: the binding of `kvtier_core::store::PageStore`, plus `page_hashes`.
//!
//! It converts arguments, keeps registered host memory alive and releases the GIL; everything else —
//! pairing K and V, page addresses, range claims, IO ordering — is the core's. Object batches are given
//! as `(key, address, length)` and every range must lie inside a registered host region; page batches name
//! token slots of the one bound pool, whose layout was checked against the registered regions once.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use kvtier_core::buffer::HostRegion;
use kvtier_core::store::{PageBatch, PageLayout, PageStore, StoreOptions};
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

    fn holds(&self, p: usize, n: u64) -> bool {
        let (b, l) = self.range();
        p >= b && (p as u128 + n as u128) <= (b as u128 + l as u128)
    }
}

/// A page store namespace (see kvtier.PageStore for the public API).
#[pyclass(name = "PageStore", module = "kvtier._native", frozen)]
pub struct PyPageStore {
    inner: RwLock<Option<Arc<PageStore>>>,
    regions: Mutex<Vec<Region>>,
}

impl PyPageStore {
    fn store(&self) -> KvResult<Arc<PageStore>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Closed("PageStore").into())
    }

    fn regions(&self) -> Vec<Region> {
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// One object batch: every range checked against the registered regions (disjoint when written) and
    /// the regions kept alive for the call, all before a byte moves; the core claims the ranges.
    fn batch(
        &self,
        py: Python<'_>,
        keys: &[String],
        ptrs: &[usize],
        sizes: &[u64],
        writes: bool,
    ) -> KvResult<Vec<bool>> {
        let s = self.store()?;
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
        let objs: Vec<(&str, usize, u64)> = keys
            .iter()
            .zip(ptrs)
            .zip(sizes)
            .map(|((k, &p), &n)| (k.as_str(), p, n))
            .collect();
        let alive = self.regions();
        for (i, &(_, p, n)) in objs.iter().enumerate() {
            if !alive.iter().any(|r| r.holds(p, n)) {
                return Err(Error::arg(
                    "host_indices",
                    format!(
                        "object {i} ({n} bytes at {p:#x}) is outside every registered host buffer"
                    ),
                )
                .into());
            }
        }
        if writes {
            let mut v: Vec<(usize, u64)> = objs.iter().map(|o| (o.1, o.2)).collect();
            v.sort_unstable();
            if v.windows(2)
                .any(|w| (w[0].0 as u128 + w[0].1 as u128) > w[1].0 as u128)
            {
                return Err(Error::arg(
                    "host_indices",
                    "two objects of one batch would be read into overlapping memory",
                )
                .into());
            }
        }
        Ok(py.detach(|| {
            let _alive = alive;
            let _claim = s.claim(&objs, writes);
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

    fn pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
        writes: bool,
    ) -> KvResult<Vec<bool>> {
        // regions first: a close() after this leaves `alive` holding them, one before makes store() fail
        let alive = self.regions(); // the bound layout lies inside these (checked by bind_pages)
        let s = self.store()?;
        let idx = crate::transfer::indices(py, "host_indices", host_indices)?;
        Ok(py.detach(|| {
            let _alive = alive;
            let batch = PageBatch {
                keys: &keys,
                host_indices: &idx,
            };
            if writes {
                s.get_pages(&batch)
            } else {
                s.put_pages(&batch)
            }
        })?)
    }
}

#[pymethods]
impl PyPageStore {
    #[new]
    #[pyo3(signature = (root, namespace, capacity_bytes, io_threads=16, direct=None, read_only=false))]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        namespace: String,
        capacity_bytes: u64,
        io_threads: usize,
        direct: Option<bool>,
        read_only: bool,
    ) -> KvResult<Self> {
        let opts = StoreOptions {
            capacity_bytes,
            io_threads,
            direct,
        };
        let s = py.detach(|| {
            if read_only {
                PageStore::open_read_only(&root, &namespace)
            } else {
                PageStore::open(&root, &namespace, opts)
            }
        })?;
        Ok(Self {
            inner: RwLock::new(Some(Arc::new(s))),
            regions: Mutex::new(Vec::new()),
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

    /// Binds the host pool whose pages `put_pages` / `get_pages` move: page p's K object is `k_len` bytes
    /// at `k_base + p*k_stride`, its V object likewise. Every page must lie inside one registered region.
    #[allow(clippy::too_many_arguments)]
    fn bind_pages(
        &self,
        k_base: usize,
        k_stride: usize,
        k_len: u64,
        v_base: usize,
        v_stride: usize,
        v_len: u64,
        page_tokens: usize,
        pages: usize,
    ) -> KvResult<()> {
        let layout = PageLayout {
            k_base,
            k_stride,
            k_len,
            v_base,
            v_stride,
            v_len,
            page_tokens,
            pages,
        };
        let regions = self.regions();
        // pages are affine in p: the first and last page of a side inside one region puts every page there
        let last = pages.saturating_sub(1);
        let sides = [
            ("K", k_base, k_stride, k_len),
            ("V", v_base, v_stride, v_len),
        ];
        for &(side, base, stride, len) in &sides[..layout.per_page()] {
            let first = (base, len);
            let end = last
                .checked_mul(stride)
                .and_then(|x| x.checked_add(base))
                .ok_or_else(|| {
                    Error::arg("pool", format!("{side} pages overflow the address space"))
                })?;
            if !regions
                .iter()
                .any(|r| r.holds(first.0, first.1) && r.holds(end, len))
            {
                return Err(Error::arg(
                    "pool",
                    format!("the {side} objects of pages 0..{pages} are not inside one registered host buffer"),
                )
                .into());
            }
        }
        // Every page's objects lie inside a registered region (checked above), and the regions stay
        // registered — alive — until close(), which drops the store; batches keep their own reference to
        // the regions while in flight. Host memory the engine writes meanwhile is the caller's to order.
        let store = self.store()?;
        // SAFETY: every page inside a registered region that outlives the binding (see above).
        Ok(unsafe { store.bind_pages(layout) }?)
    }

    /// Stores whole pages of the bound pool at `host_indices` (token slots); per key, whether K and V are
    /// both durably stored.
    fn put_pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
    ) -> KvResult<Vec<bool>> {
        self.pages(py, keys, host_indices, false)
    }

    /// Reads whole pages into the bound pool; per key, whether K and V were found and verified.
    fn get_pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
    ) -> KvResult<Vec<bool>> {
        self.pages(py, keys, host_indices, true)
    }

    /// The leading run of keys whose page (every object) is stored.
    fn pages_exist(&self, keys: Vec<String>) -> KvResult<usize> {
        Ok(self.store()?.pages_exist(&keys))
    }

    /// Deletes whole pages; returns how many had any object stored.
    fn delete_pages(&self, py: Python<'_>, keys: Vec<String>) -> KvResult<usize> {
        let s = self.store()?;
        Ok(py.detach(|| s.delete_pages(&keys))?)
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

    /// `{"checked", "corrupt", "unreadable"}`; with repair=True corrupt and unreadable objects are deleted
    /// and the journal compacted.
    fn verify<'py>(&self, py: Python<'py>, repair: bool) -> KvResult<Bound<'py, PyDict>> {
        let s = self.store()?;
        let r = py.detach(|| s.verify(repair))?;
        let d = PyDict::new(py);
        d.set_item("checked", r.checked)?;
        d.set_item("corrupt", r.corrupt)?;
        d.set_item("unreadable", r.unreadable)?;
        Ok(d)
    }

    /// `(checked, total)` objects of the running (or last) `verify`, for progress shown by another thread.
    fn verify_progress(&self) -> KvResult<(u64, u64)> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.store()?;
        Ok((
            s.stats.verify_done.load(Relaxed),
            s.stats.verify_total.load(Relaxed),
        ))
    }

    fn keys(&self) -> KvResult<Vec<String>> {
        Ok(self.store()?.keys())
    }

    /// Bytes of disk blocks the namespace's files occupy (st_blocks), for tests and inspection.
    fn disk_blocks(&self, py: Python<'_>) -> KvResult<u64> {
        let s = self.store()?;
        Ok(py.detach(|| s.disk_blocks()))
    }

    fn stats<'py>(&self, py: Python<'py>) -> KvResult<Bound<'py, PyDict>> {
        crate::store_fns::stats(py, &*self.store()?)
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

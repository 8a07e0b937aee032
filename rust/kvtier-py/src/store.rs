//! `kvtier._native.PageStore`: the binding of `kvtier_core::store::PageStore`, plus `page_hashes`.
//!
//! It converts arguments, keeps registered host memory alive and releases the GIL; everything else —
//! pairing K and V, page addresses, range claims, IO ordering — is the core's. Object batches are given
//! as `(key, address, length)` and every range must lie inside a registered host region; page batches name
//! token slots of the one bound pool, whose layout was checked against the registered regions once.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use kvtier_core::codec::Elem;
use kvtier_core::store::{PageLayout, PageStore, StoreOptions};
use kvtier_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffer::PyHostRegion;
use crate::errors::KvResult;
use crate::seal::PyKeyring;

/// A page store namespace (see kvtier.PageStore for the public API). `maintenance=True` opens it for a
/// maintenance command (an erase, a repair): the counters and capacity its engine left in `STATS` are kept.
#[pyclass(name = "PageStore", module = "kvtier._native", frozen)]
pub struct PyPageStore {
    inner: RwLock<Option<Arc<PageStore>>>,
}

impl PyPageStore {
    /// A read's two passes (`layers`, `first_layers`, `gate`), or none; refused for a staged read or a write.
    fn split_of(
        layers: usize,
        first_layers: usize,
        gate: Option<PyRef<'_, crate::engine::PyHostGate>>,
        staged: bool,
        write: bool,
    ) -> KvResult<Option<crate::store_batches::Split>> {
        let split = (layers != 0 || first_layers != 0)
            .then(|| (layers, first_layers, gate.map(|g| g.0.clone())));
        if split.is_some() && (staged || write) {
            let why = if write {
                "a write is one pass (no first_layers)"
            } else {
                "a staged read is one pass (no first_layers)"
            };
            return Err(Error::arg(if write { "first_layers" } else { "staged" }, why).into());
        }
        Ok(split)
    }

    pub(crate) fn store(&self) -> KvResult<Arc<PageStore>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Closed("PageStore").into())
    }
}

#[pymethods]
impl PyPageStore {
    #[new]
    #[pyo3(signature = (root, namespace, capacity_bytes, io_threads=16, direct=None, read_only=false, budget_bytes=None, keyring=None, codec=None, maintenance=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        namespace: String,
        capacity_bytes: u64,
        io_threads: usize,
        direct: Option<bool>,
        read_only: bool,
        budget_bytes: Option<u64>,
        keyring: Option<PyRef<'_, PyKeyring>>,
        codec: Option<&str>,
        maintenance: bool,
    ) -> KvResult<Self> {
        if read_only && maintenance {
            return Err(Error::arg(
                "maintenance",
                "a maintenance open writes: it cannot be read_only",
            )
            .into());
        }
        let keyring = keyring.map(|k| k.inner.clone());
        let codec = match codec {
            None => None,
            Some(name) => Some(Elem::parse(name).ok_or_else(|| {
                Error::arg(
                    "codec",
                    format!("{name:?} is not a codec; expected \"bits16\", \"bits8\" or None"),
                )
            })?),
        };
        let opts = StoreOptions {
            capacity_bytes,
            budget_bytes,
            io_threads,
            direct,
            keyring: keyring.clone(),
            codec,
        };
        let s = crate::exit::detach_io(py, || {
            if read_only {
                PageStore::open_read_only_sealed(&root, &namespace, keyring)
            } else if maintenance {
                PageStore::open_maintenance(&root, &namespace, opts)
            } else {
                PageStore::open(&root, &namespace, opts)
            }
        })?;
        Ok(Self {
            inner: RwLock::new(Some(Arc::new(s))),
        })
    }

    /// Allows IO into and out of `region` (the store keeps it alive).
    fn register_region(&self, region: &PyHostRegion) -> KvResult<()> {
        self.store()?.register_region(region.get()?);
        Ok(())
    }

    /// Allows IO into and out of a contiguous CPU tensor's bytes (`tensor.data_ptr()`, `tensor.nbytes`);
    /// the store keeps the tensor alive. For engines whose host pool memory is not kvtier's.
    fn register_tensor(&self, py: Python<'_>, tensor: Bound<'_, PyAny>) -> KvResult<()> {
        let (ptr, len, owner) = crate::ranges::tensor_range(py, tensor)?;
        // a contiguous CPU tensor's bytes are `[data_ptr, data_ptr + nbytes)`, live while its storage is,
        // which `owner` holds for as long as the store keeps the registration.
        // SAFETY: live CPU memory held by `owner` (register_foreign's contract).
        unsafe { self.store()?.register_foreign(ptr, len, owner) };
        Ok(())
    }

    /// Binds the host pool whose pages `put_pages` / `get_pages` move: page p's K object is `k_len` bytes
    /// at `k_base + p*k_stride`, its V object likewise; the core checks every page lies inside registered
    /// memory.
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
        Ok(self.store()?.bind_registered(layout)?)
    }

    /// Binds the store's staging pages (of the pool's object sizes and page tokens, inside registered
    /// memory, sharing no byte with the pool): what `get_pages`/`put_pages` move with `staged=True`.
    #[allow(clippy::too_many_arguments)]
    fn bind_staging(
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
        Ok(self.store()?.bind_staging_registered(layout)?)
    }

    /// Copies whole pages from the staging pages at `staging_indices` into the pool at `host_indices`
    /// (`to_pool`), or the other way; token slots, whole pages in order.
    fn copy_pages(
        &self,
        py: Python<'_>,
        to_pool: bool,
        host_indices: &Bound<'_, PyAny>,
        staging_indices: &Bound<'_, PyAny>,
    ) -> KvResult<()> {
        let job = self.copy_job(py, to_pool, host_indices, staging_indices)?;
        Ok(crate::exit::detach_io(py, job)?)
    }

    /// `copy_pages` on a thread of its own: answers at once with a `PendingIo` (see `kvtier._native`'s
    /// exit notes) whose result is None. Arguments are checked before it starts.
    fn submit_copy_pages(
        &self,
        py: Python<'_>,
        to_pool: bool,
        host_indices: &Bound<'_, PyAny>,
        staging_indices: &Bound<'_, PyAny>,
    ) -> KvResult<crate::exit::PyPendingIo> {
        let job = self.copy_job(py, to_pool, host_indices, staging_indices)?;
        crate::exit::submit_io(move || job().map(|()| crate::exit::Outcome::Unit))
    }

    /// `put_pages` (`write`) or `get_pages` on a thread of its own: answers at once with a `PendingIo`
    /// whose result is the per-key flags. Arguments are checked before it starts.
    #[pyo3(signature = (write, keys, host_indices, layers=0, first_layers=0, gate=None, staged=false))]
    #[allow(clippy::too_many_arguments)]
    fn submit_pages(
        &self,
        py: Python<'_>,
        write: bool,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
        layers: usize,
        first_layers: usize,
        gate: Option<PyRef<'_, crate::engine::PyHostGate>>,
        staged: bool,
    ) -> KvResult<crate::exit::PyPendingIo> {
        let split = Self::split_of(layers, first_layers, gate, staged, write)?;
        let job = self.page_job(py, keys, host_indices, split, staged, !write)?;
        crate::exit::submit_io(move || job().map(crate::exit::Outcome::Flags))
    }

    /// Stores whole pages of the bound pool at `host_indices` (token slots; of the staging pages with
    /// `staged`); per key, whether K and V are both durably stored.
    #[pyo3(signature = (keys, host_indices, staged=false))]
    fn put_pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
        staged: bool,
    ) -> KvResult<Vec<bool>> {
        self.pages(py, keys, host_indices, false, None, staged)
    }

    /// Reads whole pages into the bound pool; per key, whether K and V were found and verified. With
    /// `first_layers` (of the pool's `layers`): those layers of every page first, then `gate` opens.
    /// `staged`: into the staging pages at `host_indices` (one pass).
    #[pyo3(signature = (keys, host_indices, layers=0, first_layers=0, gate=None, staged=false))]
    #[allow(clippy::too_many_arguments)]
    fn get_pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
        layers: usize,
        first_layers: usize,
        gate: Option<PyRef<'_, crate::engine::PyHostGate>>,
        staged: bool,
    ) -> KvResult<Vec<bool>> {
        let split = Self::split_of(layers, first_layers, gate, staged, false)?;
        self.pages(py, keys, host_indices, true, split, staged)
    }

    /// The leading run of keys whose page (every object) is stored.
    fn pages_exist(&self, keys: Vec<String>) -> KvResult<usize> {
        Ok(self.store()?.pages_exist(&keys))
    }

    /// Deletes whole pages; returns how many had any object stored.
    fn delete_pages(&self, py: Python<'_>, keys: Vec<String>) -> KvResult<usize> {
        let s = self.store()?;
        Ok(crate::exit::detach_io(py, || s.delete_pages(&keys))?)
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
        Ok(crate::exit::detach_io(py, || s.delete(&refs))?)
    }

    /// Erases tenant `tag` from this namespace (bytes overwritten, records deleted and compacted away) and
    /// refuses its puts from then on; how many objects it had.
    fn erase_tenant(&self, py: Python<'_>, tag: String) -> KvResult<usize> {
        let s = self.store()?;
        Ok(crate::exit::detach_io(py, || s.erase_tenant(&tag))?)
    }

    /// Lets tenant `tag`, erased through this store, put objects again; whether it was erased here.
    fn allow_tenant(&self, tag: String) -> KvResult<bool> {
        Ok(self.store()?.allow_tenant(&tag)?)
    }

    fn clear(&self, py: Python<'_>) -> KvResult<usize> {
        let s = self.store()?;
        Ok(crate::exit::detach_io(py, || s.clear())?)
    }

    /// `{"checked", "corrupt", "unreadable"}`; with repair=True corrupt and unreadable objects are deleted
    /// and the journal compacted.
    fn verify<'py>(&self, py: Python<'py>, repair: bool) -> KvResult<Bound<'py, PyDict>> {
        crate::store_fns::verify(py, &self.store()?, repair)
    }

    /// `(checked, total)` objects of the running (or last) `verify`, for progress shown by another thread.
    fn verify_progress(&self) -> KvResult<(u64, u64)> {
        Ok(crate::store_fns::verify_progress(&*self.store()?))
    }

    fn keys(&self) -> KvResult<Vec<String>> {
        Ok(self.store()?.keys())
    }

    /// Bytes of disk blocks the namespace's files occupy (st_blocks), for tests and inspection.
    fn disk_blocks(&self, py: Python<'_>) -> KvResult<u64> {
        let s = self.store()?;
        Ok(crate::exit::detach_io(py, || s.disk_blocks()))
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
        crate::exit::detach_io(py, move || drop(s)); // registered memory goes with the store, once no batch holds it
    }
}

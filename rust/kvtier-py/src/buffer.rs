//! `kvtier._native.HostRegion`: the binding of [`kvtier_core::buffer::HostRegion`].

use std::sync::{Arc, RwLock};

use kvtier_core::buffer::{HostRegion, HugePages, RegionOptions};
use kvtier_core::Error;
use pyo3::prelude::*;

use crate::errors::KvResult;

/// Aligned anonymous host memory owned by Rust (see `kvtier.HostBuffer` for the public API).
#[pyclass(name = "HostRegion", module = "kvtier._native", frozen)]
pub struct PyHostRegion {
    inner: RwLock<Option<Arc<HostRegion>>>,
}

impl PyHostRegion {
    /// The live region, or `ClosedError`.
    pub fn get(&self) -> KvResult<Arc<HostRegion>> {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        g.clone().ok_or_else(|| Error::Closed("HostBuffer").into())
    }
}

/// Progress of a long buffer call (pre-faulting, CUDA registration), read by another thread.
#[pyclass(name = "Progress", module = "kvtier._native", frozen)]
pub struct PyProgress(Arc<kvtier_core::buffer::Progress>);

#[pymethods]
impl PyProgress {
    #[new]
    fn new() -> Self {
        Self(Arc::default())
    }
    /// `(bytes done, bytes of the step)` of the running step.
    fn get(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.0.done.load(Relaxed), self.0.total.load(Relaxed))
    }
}

#[pymethods]
impl PyHostRegion {
    #[new]
    #[pyo3(signature = (nbytes, alignment=4096, huge_pages="auto", prefault_threads=None, progress=None))]
    fn new(
        py: Python<'_>,
        nbytes: i64,
        alignment: i64,
        huge_pages: &str,
        prefault_threads: Option<i64>,
        progress: Option<PyRef<'_, PyProgress>>,
    ) -> KvResult<Self> {
        if nbytes <= 0 {
            return Err(Error::arg("nbytes", format!("must be positive, got {nbytes}")).into());
        }
        if alignment <= 0 {
            return Err(Error::arg(
                "alignment",
                format!("must be a power of two >= 4096, got {alignment}"),
            )
            .into());
        }
        let prefault_threads = match prefault_threads {
            Some(t) if t < 0 => {
                return Err(Error::arg("prefault_threads", format!("must be >= 0, got {t}")).into())
            }
            t => t.map(|t| t as usize),
        };
        let opts = RegionOptions {
            alignment: alignment as usize,
            huge_pages: HugePages::parse(huge_pages)?,
            prefault_threads,
            progress: progress.map(|p| p.0.clone()),
        };
        let region = py.detach(|| HostRegion::new(nbytes as usize, &opts))?;
        Ok(Self {
            inner: RwLock::new(Some(Arc::new(region))),
        })
    }

    /// Base address.
    #[getter]
    fn ptr(&self) -> KvResult<usize> {
        Ok(self.get()?.as_ptr() as usize)
    }
    /// Usable bytes (the request rounded up to whole pages).
    #[getter]
    fn nbytes(&self) -> KvResult<usize> {
        Ok(self.get()?.len())
    }
    /// Requested base alignment.
    #[getter]
    fn alignment(&self) -> KvResult<usize> {
        Ok(self.get()?.alignment())
    }
    /// "base", "transparent" or "explicit".
    #[getter]
    fn page_kind(&self) -> KvResult<&'static str> {
        Ok(self.get()?.page_kind().as_str())
    }
    /// Why fewer huge pages than asked for were used, or None.
    #[getter]
    fn fallback(&self) -> KvResult<Option<String>> {
        Ok(self.get()?.fallback().map(str::to_owned))
    }
    /// True after close().
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// DLPack capsule of `[offset, offset+nbytes)` as 1-D uint8; keeps the memory alive.
    fn dlpack<'py>(
        &self,
        py: Python<'py>,
        offset: i64,
        nbytes: i64,
    ) -> KvResult<Bound<'py, PyAny>> {
        let r = self.get()?;
        if offset < 0 || nbytes < 0 || (offset as u128 + nbytes as u128) > r.len() as u128 {
            return Err(Error::arg(
                "shape",
                format!(
                    "bytes [{offset}, {offset}+{nbytes}) do not fit in the buffer's {} bytes",
                    r.len()
                ),
            )
            .into());
        }
        Ok(crate::dlpack::capsule(
            py,
            r,
            offset as usize,
            nbytes as usize,
        )?)
    }

    /// Registers the region with the CUDA driver (see kvtier_core::buffer::HostRegion::register_cuda).
    #[pyo3(signature = (device, granularity, max_chunk, threads, progress=None))]
    fn register_cuda(
        &self,
        py: Python<'_>,
        device: i32,
        granularity: usize,
        max_chunk: usize,
        threads: usize,
        progress: Option<PyRef<'_, PyProgress>>,
    ) -> KvResult<usize> {
        let r = self.get()?;
        let p = progress.map(|p| p.0.clone());
        Ok(py.detach(|| r.register_cuda(device, granularity, max_chunk, threads, p.as_deref()))?)
    }

    /// (offset, nbytes) of each CUDA registration.
    fn registered_chunks(&self) -> KvResult<Vec<(usize, usize)>> {
        Ok(self.get()?.registered_chunks())
    }

    /// Drops this handle's reference; the memory is unmapped (and unregistered) once no view remains.
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        // Dropping the last Arc munmaps (and may unregister): do it without the GIL.
        py.detach(move || drop(taken));
    }
}

/// True when `addr` is host memory registered with the CUDA driver (for tests and diagnostics).
#[pyfunction]
#[pyo3(signature = (addr, device=0))]
pub fn cuda_host_registered(addr: usize, device: i32) -> KvResult<bool> {
    Ok(kvtier_core::cuda::is_host_registered(device, addr)?)
}

/// True when the CUDA driver loads on this machine.
#[pyfunction]
pub fn cuda_driver_available() -> bool {
    kvtier_core::cuda::available()
}

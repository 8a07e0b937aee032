//! `kvtier._native.HostRanges`: the binding of `kvtier_core::ranges::Ranges` — registered host memory,
//! range checks and checksums, for tiers whose IO another library performs (the Mooncake cluster tier).

use std::any::Any;
use std::sync::Arc;

use kvtier_core::ranges::Ranges;
use kvtier_core::Error;
use pyo3::prelude::*;

use crate::buffer::PyHostRegion;
use crate::errors::KvResult;

/// `(address, length, owner)` of a contiguous CPU tensor's bytes; the owner holds the tensor and its storage
/// (`set_()` on the tensor would otherwise free registered memory; a reallocating `resize_` of a registered
/// tensor is not covered: registered buffers must not be resized).
pub(crate) fn tensor_range(
    py: Python<'_>,
    tensor: Bound<'_, PyAny>,
) -> KvResult<(usize, usize, Arc<dyn Any + Send + Sync>)> {
    let contiguous: bool = tensor.call_method0("is_contiguous")?.extract()?;
    let device: String = tensor.getattr("device")?.getattr("type")?.extract()?;
    if !contiguous || device != "cpu" {
        return Err(Error::arg("pool", format!("host buffers must be contiguous CPU tensors (got device {device:?}, contiguous={contiguous})")).into());
    }
    let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
    let len: usize = tensor.getattr("nbytes")?.extract()?;
    let storage = tensor.call_method0("untyped_storage")?;
    let owner = Arc::new(
        pyo3::types::PyTuple::new(py, [tensor, storage])?
            .into_any()
            .unbind(),
    );
    Ok((ptr, len, owner))
}

/// Registered host memory (see the module docs).
#[pyclass(name = "HostRanges", module = "kvtier._native", frozen)]
pub struct PyHostRanges {
    inner: Arc<Ranges>,
}

fn spans(ptrs: &[usize], sizes: &[u64]) -> KvResult<Vec<(usize, u64)>> {
    if ptrs.len() != sizes.len() {
        return Err(Error::arg(
            "sizes",
            format!("{} addresses and {} sizes", ptrs.len(), sizes.len()),
        )
        .into());
    }
    Ok(ptrs.iter().copied().zip(sizes.iter().copied()).collect())
}

impl PyHostRanges {
    pub(crate) fn get(&self) -> &Ranges {
        &self.inner
    }
}

#[pymethods]
impl PyHostRanges {
    #[new]
    fn new() -> Self {
        Self {
            inner: Arc::new(Ranges::default()),
        }
    }

    /// Allows IO into and out of `region` (kept alive as long as this registry).
    fn register_region(&self, region: &PyHostRegion) -> KvResult<()> {
        self.inner.register_region(region.get()?);
        Ok(())
    }

    /// Allows IO into and out of a contiguous CPU tensor's bytes; the registry keeps the tensor alive.
    fn register_tensor(&self, py: Python<'_>, tensor: Bound<'_, PyAny>) -> KvResult<()> {
        let (ptr, len, owner) = tensor_range(py, tensor)?;
        // a contiguous CPU tensor's bytes are `[data_ptr, data_ptr + nbytes)`, live while its storage is,
        // which `owner` holds for as long as the registry keeps the registration.
        // SAFETY: live CPU memory held by `owner` (register_foreign's contract).
        unsafe { self.inner.register_foreign(ptr, len, owner) };
        Ok(())
    }

    /// Raises InvalidArgumentError (naming `what`) unless every `(ptrs[i], sizes[i])` lies inside registered
    /// memory and, with `disjoint`, no two overlap.
    #[pyo3(signature = (ptrs, sizes, disjoint, what = "host_indices"))]
    fn check(&self, ptrs: Vec<usize>, sizes: Vec<u64>, disjoint: bool, what: &str) -> KvResult<()> {
        Ok(self
            .inner
            .snapshot()
            .check(what, &spans(&ptrs, &sizes)?, disjoint)?)
    }

    /// crc32c of each object's bytes followed by its key, every range checked first (GIL released).
    fn crc32c(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<u64>,
    ) -> KvResult<Vec<u32>> {
        let sp = spans(&ptrs, &sizes)?;
        if keys.len() != sp.len() {
            return Err(Error::arg(
                "keys",
                format!("{} keys for {} objects", keys.len(), sp.len()),
            )
            .into());
        }
        let inner = self.inner.clone();
        py.detach(move || {
            let objs: Vec<(&str, usize, u64)> = keys
                .iter()
                .zip(&sp)
                .map(|(k, s)| (k.as_str(), s.0, s.1))
                .collect();
            Ok(inner.crc32c(&objs)?)
        })
    }

    /// Number of registered ranges.
    fn __len__(&self) -> usize {
        self.inner.snapshot().len()
    }
}

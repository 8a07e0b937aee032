//! Page allocation and transfer validation bindings (`kvtier_core::{alloc, plan}`); plans are in `plans.rs`,
//! submissions in `engine.rs`.

use kvtier_core::alloc::PageAllocator;
use kvtier_core::plan::{self, HostGeometry, IndexRules, Layout};
use kvtier_core::Error;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::errors::KvResult;

pub(crate) fn indices(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> KvResult<Vec<i64>> {
    let buf = PyBuffer::<i64>::get(obj)
        .map_err(|e| Error::arg(name, format!("must be a 1-D int64 buffer ({e})")))?;
    if buf.dimensions() != 1 {
        return Err(Error::arg(
            name,
            format!("must be 1-D, got {} dimensions", buf.dimensions()),
        )
        .into());
    }
    buf.to_vec(py)
        .map_err(|e| Error::arg(name, format!("cannot be read: {e}")).into())
}

/// Whole-page token-slot allocator (thread-safe).
#[pyclass(name = "PageAllocator", module = "kvtier._native", frozen)]
pub struct PyPageAllocator(PageAllocator);

#[pymethods]
impl PyPageAllocator {
    #[new]
    fn new(page_num: usize, page_size: usize) -> KvResult<Self> {
        Ok(Self(PageAllocator::new(page_num, page_size)?))
    }
    /// Token slots (whole pages) or None when there is not enough room.
    fn alloc(&self, need_size: i64) -> KvResult<Option<Vec<i64>>> {
        if need_size < 0 {
            return Err(Error::arg("need_size", format!("must be >= 0, got {need_size}")).into());
        }
        Ok(self.0.alloc(need_size as usize)?)
    }
    /// Frees whole pages; returns the slot count.
    fn free(&self, py: Python<'_>, indices_: &Bound<'_, PyAny>) -> KvResult<usize> {
        let v = indices(py, "indices", indices_)?;
        Ok(self.0.free(&v)?)
    }
    fn available(&self) -> usize {
        self.0.available()
    }
    fn is_allocated(&self, slot: usize) -> bool {
        self.0.is_allocated(slot)
    }
    fn clear(&self) {
        self.0.clear()
    }
}

pub(crate) fn rules(
    host_slots: usize,
    device_rows: usize,
    page_size: usize,
    host_pages: bool,
    device_runs: bool,
    to_host: bool,
) -> IndexRules {
    IndexRules {
        host_slots,
        device_rows,
        page_size,
        host_pages,
        device_runs,
        destination_is_host: to_host,
    }
}

/// Page numbers of whole-page token-slot `indices` in a pool of `page_num` pages (ValueError otherwise).
#[pyfunction]
pub fn page_numbers(
    py: Python<'_>,
    indices_: &Bound<'_, PyAny>,
    page_size: usize,
    page_num: usize,
) -> KvResult<Vec<usize>> {
    if page_size == 0 {
        return Err(Error::arg("page_size", "must be positive, got 0").into());
    }
    let v = indices(py, "indices", indices_)?;
    Ok(kvtier_core::alloc::page_starts(
        &v, page_size, page_num, "indices",
    )?)
}

/// The host layout's byte strides `(page, token, layer)` and the bytes of one page (all layers), from the
/// core's `HostGeometry`: what the kernels and the Python views are given instead of deriving them again.
#[pyfunction]
pub fn host_layout(
    layout: &str,
    layers: usize,
    slots: usize,
    page_size: usize,
    row_bytes: usize,
) -> KvResult<(usize, usize, usize, usize)> {
    let g = HostGeometry::new(Layout::parse(layout)?, layers, slots, page_size, row_bytes)?;
    let st = g.strides();
    Ok((st.page, st.token, st.layer, g.page_bytes()))
}

/// The byte extents `(offset, len)` of each page of `pages` (one per page in page-first layouts, one per
/// layer in `layer_first`), in order; a page number out of range is a ValueError naming `pages`.
#[pyfunction]
pub fn page_extents(
    layout: &str,
    layers: usize,
    slots: usize,
    page_size: usize,
    row_bytes: usize,
    pages: Vec<usize>,
) -> KvResult<Vec<(usize, usize)>> {
    let g = HostGeometry::new(Layout::parse(layout)?, layers, slots, page_size, row_bytes)?;
    let page_num = slots / page_size;
    if let Some(p) = pages.iter().find(|&&p| p >= page_num) {
        return Err(
            Error::arg("pages", format!("page {p} is out of range [0, {page_num})")).into(),
        );
    }
    Ok(pages.iter().flat_map(|&p| g.page_extents(p)).collect())
}

/// Validates transfer indices (ranges, page structure, distinct destinations). Raises ValueError naming
/// the argument.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn validate_transfer(
    py: Python<'_>,
    host_indices: &Bound<'_, PyAny>,
    device_indices: &Bound<'_, PyAny>,
    host_slots: usize,
    device_rows: usize,
    page_size: usize,
    host_pages: bool,
    device_runs: bool,
    to_host: bool,
) -> KvResult<()> {
    let h = indices(py, "host_indices", host_indices)?;
    let d = indices(py, "device_indices", device_indices)?;
    let r = rules(
        host_slots,
        device_rows,
        page_size,
        host_pages,
        device_runs,
        to_host,
    );
    Ok(py.detach(|| plan::validate(&h, &d, &r))?)
}

/// True when `cuMemcpyBatchAsync_v2` can be used in this process.
#[pyfunction]
pub fn cuda_batch_supported() -> bool {
    kvtier_core::cuda::batch_supported()
}

//! Transfer plan bindings (`kvtier_core::engine::Plan`): device tensors converted into address ranges and
//! the objects that own them, indices read once; the submissions are in `engine.rs`.

use kvtier_core::engine::{self, Plan, PlanRequest};
use kvtier_core::plan::{Direction, HostGeometry, Layout, RawRange};
use kvtier_core::Error;
use pyo3::prelude::*;

use crate::buffer::PyHostRegion;
use crate::errors::KvResult;
use crate::transfer::{indices, rules};

/// A validated, planned copy of one side (K or V) for a fixed index pair, reusable across calls: per-layer
/// loads plan once and then copy one layer at a time with a single native call each — with CPU `memcpy`
/// for CPU device tensors, or on a CUDA stream with the copy engine (`engine.rs`).
#[pyclass(name = "TransferPlan", module = "kvtier._native", frozen)]
pub struct PyTransferPlan {
    pub(crate) plan: Plan,
    /// Keeps the device tensors and their storages alive as long as the plan can be submitted (holding
    /// the storage covers `set_()`, which moves a tensor to other storage; it does not cover a
    /// reallocating `resize_`, which swaps the memory inside the same storage: callers must not resize
    /// tensors a plan was made for — the pools re-read every layer's address per call and replan).
    _owners: Py<PyAny>,
}

/// The side-specific part of a plan request: the device tensors converted to ranges (checked contiguous, of
/// one kind, and inside their storages), and the Python objects that own them.
#[allow(clippy::too_many_arguments)]
fn request<'py>(
    region: &PyHostRegion,
    host_offset: usize,
    layout: &str,
    slots: usize,
    page_size: usize,
    row_bytes: usize,
    device_layers: &[Bound<'py, PyAny>],
    h: Vec<i64>,
    d: Vec<i64>,
    layers: std::ops::Range<usize>,
    host_pages: bool,
    device_runs: bool,
    to_host: bool,
    split: usize,
) -> KvResult<(PlanRequest, Vec<Bound<'py, PyAny>>)> {
    let region = region.get()?;
    let geo = HostGeometry::new(
        Layout::parse(layout)?,
        device_layers.len(),
        slots,
        page_size,
        row_bytes,
    )?;
    let mut device = Vec::with_capacity(device_layers.len());
    let mut rows = usize::MAX;
    let mut kinds = std::collections::BTreeSet::new();
    let mut owners = Vec::with_capacity(2 * device_layers.len());
    for (i, t) in device_layers.iter().enumerate() {
        // `nbytes` spans the tensor's memory only when it is contiguous (an expanded view reports more
        // bytes than it has); every range below is trusted to be exactly the tensor's memory.
        let contiguous: bool = t.call_method0("is_contiguous")?.extract()?;
        let kind: String = t.getattr("device")?.getattr("type")?.extract()?;
        if !contiguous || (kind != "cpu" && kind != "cuda") {
            return Err(Error::arg(
                "device_layers",
                format!("[{i}] must be a contiguous CPU or CUDA tensor (device {kind:?}, contiguous={contiguous})"),
            )
            .into());
        }
        let ptr: usize = t.call_method0("data_ptr")?.extract()?;
        let len: usize = t.getattr("nbytes")?.extract()?;
        // (a CPU range overlapping a host region of the transfer is refused by the core's plan)
        // ... and lies inside its storage: a storage shrunk in place (`untyped_storage().resize_`) keeps the
        // tensor's shape, so `nbytes` alone would span memory the tensor no longer owns.
        let storage = t.call_method0("untyped_storage")?;
        let s_ptr: usize = storage.call_method0("data_ptr")?.extract()?;
        let s_len: usize = storage.call_method0("nbytes")?.extract()?;
        if len > 0 && (ptr < s_ptr || ptr.saturating_add(len) > s_ptr.saturating_add(s_len)) {
            return Err(Error::arg(
                "device_layers",
                format!("[{i}] spans {len} bytes that its storage ({s_len} bytes) does not hold (was it resized?)"),
            )
            .into());
        }
        kinds.insert(kind);
        rows = rows.min(len / row_bytes);
        device.push(RawRange { ptr, len });
        owners.push(t.clone());
        owners.push(storage);
    }
    if kinds.len() > 1 {
        return Err(Error::arg("device_layers", "mixes CPU and CUDA tensors").into());
    }
    let req = PlanRequest {
        geo,
        region,
        host_offset,
        device,
        cuda: kinds.contains("cuda"),
        host_indices: h,
        device_indices: d,
        rules: rules(slots, rows, page_size, host_pages, device_runs, to_host),
        layers,
        dir: if to_host {
            Direction::DeviceToHost
        } else {
            Direction::HostToDevice
        },
        split,
    };
    Ok((req, owners))
}

fn wrap(py: Python<'_>, plan: Plan, owners: Vec<Bound<'_, PyAny>>) -> KvResult<PyTransferPlan> {
    let owners = pyo3::types::PyList::new(py, owners)?.into_any().unbind();
    Ok(PyTransferPlan {
        plan,
        _owners: owners,
    })
}

/// One side of `plan_sides`: `(region, host_offset, row_bytes, device_layers, split)`.
type SideArgs<'py> = (
    PyRef<'py, PyHostRegion>,
    usize,
    usize,
    Vec<Bound<'py, PyAny>>,
    usize,
);

/// `plan_sides`' `run`: `(layer_begin, layer_end, device, stream, side_streams, batch, per_layer, events)`;
/// `device` < 0 runs CPU `memcpy` (the rest ignored).
type RunArgs = (usize, usize, i32, usize, Vec<usize>, bool, bool, Vec<usize>);

/// Plans every side of one transfer (a pool's K and V) with one validation of the shared indices (see
/// `kvtier_core::engine::Plan::new_sides`): one native call where a TransferPlan per side took one each and
/// validated the indices each time. With `run`, also copies (CPU) or submits (CUDA) those layers in the same
/// call (`kvtier_core::engine::plan_and_run`) and returns `(plans, (copies, batch_calls))`; the caller keeps
/// the device tensors alive as `submit_layers` requires.
#[pyfunction]
#[pyo3(signature = (to_host, layout, slots, page_size, host_indices, device_indices, layer_begin, layer_end,
    host_pages, device_runs, sides, run=None))]
#[allow(clippy::too_many_arguments)]
pub fn plan_sides<'py>(
    py: Python<'py>,
    to_host: bool,
    layout: &str,
    slots: usize,
    page_size: usize,
    host_indices: &Bound<'py, PyAny>,
    device_indices: &Bound<'py, PyAny>,
    layer_begin: usize,
    layer_end: usize,
    host_pages: bool,
    device_runs: bool,
    sides: Vec<SideArgs<'py>>,
    run: Option<RunArgs>,
) -> KvResult<(Vec<PyTransferPlan>, (usize, usize))> {
    let h = indices(py, "host_indices", host_indices)?;
    let d = indices(py, "device_indices", device_indices)?;
    let mut reqs = Vec::with_capacity(sides.len());
    let mut owners = Vec::with_capacity(sides.len());
    for (region, host_offset, row_bytes, device_layers, split) in &sides {
        let (req, own) = request(
            region,
            *host_offset,
            layout,
            slots,
            page_size,
            *row_bytes,
            device_layers,
            h.clone(),
            d.clone(),
            layer_begin..layer_end,
            host_pages,
            device_runs,
            to_host,
            *split,
        )?;
        reqs.push(req);
        owners.push(own);
    }
    let (plans, counts) = match run {
        None => (py.detach(|| Plan::new_sides(reqs))?, (0, 0)),
        Some((begin, end, device, stream, side_streams, batch, per_layer, events)) => {
            let run = if device < 0 {
                engine::Run::Cpu { layers: begin..end }
            } else {
                engine::Run::Cuda {
                    layers: begin..end,
                    device,
                    stream,
                    side_streams: &side_streams,
                    batch,
                    per_layer,
                    events: &events,
                }
            };
            // the device ranges are the memory of the tensors `owners` holds (CPU ones checked disjoint from
            // the host region by `request`), live for the call; the caller keeps CUDA memory alive until the
            // stream passes the copies and passes live streams and events (submit_layers' contract).
            // SAFETY: plan_and_run's contract, upheld as described above.
            py.detach(|| unsafe { engine::plan_and_run(reqs, run) })?
        }
    };
    let plans = plans
        .into_iter()
        .zip(owners)
        .map(|(p, o)| wrap(py, p, o))
        .collect::<KvResult<Vec<_>>>()?;
    Ok((plans, counts))
}

#[pymethods]
impl PyTransferPlan {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        to_host: bool,
        region: &PyHostRegion,
        host_offset: usize,
        layout: &str,
        slots: usize,
        page_size: usize,
        row_bytes: usize,
        device_layers: Vec<Bound<'_, PyAny>>,
        host_indices: &Bound<'_, PyAny>,
        device_indices: &Bound<'_, PyAny>,
        layer_begin: usize,
        layer_end: usize,
        host_pages: bool,
        device_runs: bool,
        split: usize,
    ) -> KvResult<Self> {
        let h = indices(py, "host_indices", host_indices)?;
        let d = indices(py, "device_indices", device_indices)?;
        let (req, owners) = request(
            region,
            host_offset,
            layout,
            slots,
            page_size,
            row_bytes,
            &device_layers,
            h,
            d,
            layer_begin..layer_end,
            host_pages,
            device_runs,
            to_host,
            split,
        )?;
        let plan = py.detach(|| Plan::new(req))?;
        wrap(py, plan, owners)
    }
}

//! Submission bindings (`kvtier_core::engine`): Python arguments converted, the GIL released, nothing else.

use kvtier_core::cuda::Kernel;
use kvtier_core::engine::{self, KernelLaunch, Plan, Submission};
use pyo3::prelude::*;

use crate::errors::KvResult;
use crate::plans::PyTransferPlan;

fn plans<'a>(plans: &'a [PyRef<'_, PyTransferPlan>]) -> Vec<&'a Plan> {
    plans.iter().map(|p| &p.plan).collect()
}

/// Enqueues layers `[layer_begin, layer_end)` of every plan on CUDA `stream` of `device` (see
/// `kvtier_core::engine::submit_layers`). Returns `(copies, batch_calls)`. The caller keeps the device
/// tensors alive until `stream` passes the copies (the plans hold them while referenced), and passes live
/// CUDA events (`torch.cuda.Event.cuda_event`) and streams of that device.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn submit_layers(
    py: Python<'_>,
    plans: Vec<PyRef<'_, PyTransferPlan>>,
    layer_begin: usize,
    layer_end: usize,
    device: i32,
    stream: usize,
    side_streams: Vec<usize>,
    batch: bool,
    per_layer: bool,
    events: Vec<usize>,
) -> KvResult<(usize, usize)> {
    let refs = self::plans(&plans);
    Ok(py.detach(|| {
        engine::submit_layers(
            &refs,
            layer_begin,
            layer_end,
            device,
            stream,
            &side_streams,
            batch,
            per_layer,
            &events,
        )
    })?)
}

/// `submit_layers` from a default stream `caller` through the `detour` stream, forked and joined with the
/// events `fork` and `join`, then `mark` (0 = none) recorded on `caller` (see
/// `kvtier_core::engine::submit_layers_detour`). Returns `(copies, batch_calls)`. The caller's contract is
/// `submit_layers`'.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn submit_layers_detour(
    py: Python<'_>,
    plans: Vec<PyRef<'_, PyTransferPlan>>,
    layer_begin: usize,
    layer_end: usize,
    device: i32,
    caller: usize,
    detour: usize,
    fork: usize,
    join: usize,
    batch: bool,
    mark: usize,
) -> KvResult<(usize, usize)> {
    let refs = self::plans(&plans);
    Ok(py.detach(|| {
        engine::submit_layers_detour(
            &refs,
            layer_begin,
            layer_end,
            device,
            caller,
            detour,
            fork,
            join,
            batch,
            mark,
        )
    })?)
}

/// Copies layers `[layer_begin, layer_end)` of every plan now with CPU `memcpy` (CPU device tensors), in one
/// native call with the GIL released.
#[pyfunction]
pub fn copy_cpu(
    py: Python<'_>,
    plans: Vec<PyRef<'_, PyTransferPlan>>,
    layer_begin: usize,
    layer_end: usize,
) -> KvResult<()> {
    let refs = self::plans(&plans);
    py.detach(|| -> kvtier_core::Result<()> {
        for p in &refs {
            // each plan's device ranges are the memory of contiguous CPU tensors its `_owners` holds (checked
            // when it was made, disjoint from the host region); the plan re-checks every chunk.
            // SAFETY: live, disjoint CPU ranges held by the plans (Plan::copy_cpu's contract).
            unsafe { p.copy_cpu(layer_begin, layer_end)? };
        }
        Ok(())
    })?;
    Ok(())
}

/// A per-layer submission running on a native thread (`kvtier_core::engine::Submission`).
#[pyclass(name = "Submission", module = "kvtier._native", frozen)]
pub struct PySubmission(Submission);

#[pymethods]
impl PySubmission {
    /// Blocks (GIL released) until the events of layer `index` have been recorded; raises the submission's
    /// error if it failed first.
    fn wait_recorded(&self, py: Python<'_>, index: usize) -> KvResult<()> {
        Ok(py.detach(|| self.0.wait_recorded(index))?)
    }
    /// Blocks (GIL released) until every copy has been submitted; raises the submission's error if any.
    fn join(&self, py: Python<'_>) -> KvResult<()> {
        Ok(py.detach(|| self.0.join())?)
    }
    /// True once every copy has been submitted (or the submission failed).
    fn finished(&self) -> bool {
        self.0.finished()
    }
}

/// As `submit_layers` with `per_layer=True`, submitted by a native thread (see
/// `kvtier_core::engine::submit_layers_background` for the ordering and lifetime contract).
#[pyfunction]
#[pyo3(signature = (plans, layer_begin, layer_end, device, stream, side_streams, batch, events, after=0, previous=None))]
#[allow(clippy::too_many_arguments)]
pub fn submit_layers_background(
    plans: Vec<PyRef<'_, PyTransferPlan>>,
    layer_begin: usize,
    layer_end: usize,
    device: i32,
    stream: usize,
    side_streams: Vec<usize>,
    batch: bool,
    events: Vec<usize>,
    after: usize,
    previous: Option<PyRef<'_, PySubmission>>,
) -> KvResult<PySubmission> {
    let refs = self::plans(&plans);
    let previous = previous.as_ref().map(|p| &p.0);
    let sub = engine::submit_layers_background(
        &refs,
        layer_begin,
        layer_end,
        device,
        stream,
        side_streams,
        batch,
        &events,
        after,
        previous,
    )?;
    Ok(PySubmission(sub))
}

/// Enqueues compiled-kernel launches for layers `[layer_begin, layer_end)` (see
/// `kvtier_core::engine::launch_layers`). Each launch is `(function, grid, block, shared_bytes, widths,
/// values, layer_param)`: `widths[i]` is 4 or 8, the byte width of parameter i.
///
/// `mark`: an event recorded on `stream` after every launch (0 = none).
///
/// Private to `kvtier.kernels` and the transfer engine's warm per-layer load, which pass only functions
/// kvtier.kernels compiled, whose parameter list it checked against the compiled code, and addresses of
/// buffers they validated and keep alive.
#[pyfunction]
#[pyo3(signature = (device, stream, side_streams, launches, layer_begin, layer_end, events, mark=0))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn launch_layers(
    py: Python<'_>,
    device: i32,
    stream: usize,
    side_streams: Vec<usize>,
    launches: Vec<(usize, u32, u32, u32, Vec<u8>, Vec<u64>, usize)>,
    layer_begin: usize,
    layer_end: usize,
    events: Vec<usize>,
    mark: usize,
) -> KvResult<()> {
    let launches = launches
        .into_iter()
        .enumerate()
        .map(
            |(i, (function, grid, block, shared, widths, values, layer_param))| {
                KernelLaunch::new(
                    i,
                    Kernel {
                        function,
                        grid,
                        block,
                        shared,
                    },
                    &widths,
                    &values,
                    layer_param,
                )
            },
        )
        .collect::<kvtier_core::Result<Vec<_>>>()?;
    // kvtier.kernels (the only caller) passes functions it compiled in this context, whose parameter
    // widths it read from the compiled code, and addresses of validated buffers and index tensors it keeps
    // alive until `stream` (which joins every lane) has passed the launches.
    // SAFETY: launch_layers' contract, upheld by kvtier.kernels as described above.
    Ok(py.detach(|| unsafe {
        engine::launch_layers(
            device,
            stream,
            &side_streams,
            launches,
            layer_begin,
            layer_end,
            &events,
            mark,
        )
    })?)
}

/// Sets how many descriptors go into one `cuMemcpyBatchAsync` call (benches); returns the previous value.
#[pyfunction]
pub fn cuda_set_batch_limit(limit: usize) -> usize {
    kvtier_core::cuda::set_batch_limit(limit)
}

/// The `CUmemcpyFlags` in use for batched copies (diagnostics).
#[pyfunction]
pub fn cuda_batch_flags() -> u32 {
    kvtier_core::cuda::batch_flags()
}

/// A gate a stream's later work waits at until the host opens it (`kvtier_core::cuda::HostGate`); opened
/// when the last reference to it goes.
#[pyclass(name = "HostGate", module = "kvtier._native", frozen)]
pub struct PyHostGate(pub(crate) std::sync::Arc<kvtier_core::cuda::HostGate>);

#[pymethods]
impl PyHostGate {
    #[new]
    fn new() -> Self {
        Self(std::sync::Arc::new(kvtier_core::cuda::HostGate::new()))
    }
    /// Opens the gate (idempotent): every stream waiting at it goes on.
    fn open(&self) {
        self.0.open()
    }
    /// True once opened.
    #[getter]
    fn is_open(&self) -> bool {
        self.0.is_open()
    }
}

/// Enqueues `gate` on CUDA `stream` of `device` from a native thread, after `previous` (see
/// `kvtier_core::engine::submit_gate_background`); `stream` must be a live stream of that device.
#[pyfunction]
#[pyo3(signature = (device, stream, gate, previous=None))]
pub fn submit_gate_background(
    device: i32,
    stream: usize,
    gate: PyRef<'_, PyHostGate>,
    previous: Option<PyRef<'_, PySubmission>>,
) -> KvResult<PySubmission> {
    let previous = previous.as_ref().map(|p| &p.0);
    Ok(PySubmission(engine::submit_gate_background(
        device,
        stream,
        gate.0.clone(),
        previous,
    )?))
}

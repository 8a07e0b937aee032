//! Page allocation and transfer validation/copy bindings (`kvtier_core::{alloc, plan}`).

use kvtier_core::alloc::PageAllocator;
use kvtier_core::plan::{self, Direction, HostGeometry, IndexRules, Layout, RawRange};
use kvtier_core::Error;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::buffer::PyHostRegion;
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

fn rules(
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

/// A validated-on-demand transfer request: geometry, buffers and indices extracted from Python.
struct Request {
    geo: HostGeometry,
    host: RawRange,
    device: Vec<RawRange>,
    h: Vec<i64>,
    d: Vec<i64>,
    rules: IndexRules,
    layers: std::ops::Range<usize>,
    dir: Direction,
    host_offset: usize,
    _region: std::sync::Arc<kvtier_core::buffer::HostRegion>,
}

impl Request {
    /// Validates the indices, plans the chunks (never crossing a multiple of `split` host bytes) and
    /// checks every chunk against both buffers.
    fn plan(&self, split: usize) -> kvtier_core::Result<Vec<plan::Chunk>> {
        plan::validate(&self.h, &self.d, &self.rules)?;
        let chunks = plan::plan(
            &self.geo,
            &self.h,
            &self.d,
            self.layers.clone(),
            split,
            self.host_offset,
        );
        plan::check_chunks(self.host, &self.device, &chunks)?;
        Ok(chunks)
    }
}

/// True when `cuMemcpyBatchAsync_v2` can be used in this process.
#[pyfunction]
pub fn cuda_batch_supported() -> bool {
    kvtier_core::cuda::batch_supported()
}

/// A validated, planned copy of one side (K or V) for a fixed index pair, reusable across calls: per-layer
/// loads plan once and then copy one layer at a time with a single native call each — with CPU `memcpy`
/// for CPU device tensors, or on a CUDA stream with the copy engine.
#[pyclass(name = "TransferPlan", module = "kvtier._native", frozen)]
pub struct PyTransferPlan {
    req: Request,
    /// Every chunk, in layer order (`plan::plan` emits them layer by layer).
    chunks: Vec<plan::Chunk>,
    /// `chunks[layer_start[i]..layer_start[i + 1]]` are the chunks of layer `layers.start + i`.
    layer_start: Vec<usize>,
    /// Keeps the device tensors and their storages alive as long as the plan can be submitted (holding
    /// the storage covers `set_()`, which moves a tensor to other storage; it does not cover a
    /// reallocating `resize_`, which swaps the memory inside the same storage: callers must not resize
    /// tensors a plan was made for — the pools re-read every layer's address per call and replan).
    _owners: Py<PyAny>,
    /// Whether the device tensors are CUDA tensors (copied by the copy engine) or CPU ones (`copy_cpu`).
    cuda: bool,
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
        let region = region.get()?;
        let layers = device_layers.len();
        let geo = HostGeometry::new(Layout::parse(layout)?, layers, slots, page_size, row_bytes)?;
        if host_offset
            .checked_add(geo.nbytes())
            .is_none_or(|end| end > region.len())
        {
            return Err(Error::arg(
                "size",
                format!(
                    "geometry needs {} bytes at offset {host_offset}, buffer has {}",
                    geo.nbytes(),
                    region.len()
                ),
            )
            .into());
        }
        if layer_begin >= layer_end || layer_end > layers {
            return Err(Error::arg(
                "layer_id",
                format!("layers [{layer_begin}, {layer_end}) not in [0, {layers})"),
            )
            .into());
        }
        let mut device = Vec::with_capacity(layers);
        let mut rows = usize::MAX;
        let mut kinds = std::collections::BTreeSet::new();
        let mut owners = Vec::with_capacity(2 * layers);
        let host_span = region.as_ptr() as usize..region.as_ptr() as usize + region.len();
        for (i, t) in device_layers.iter().enumerate() {
            // `nbytes` spans the tensor's memory only when it is contiguous (an expanded view reports
            // more bytes than it has); every range below is trusted to be exactly the tensor's memory.
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
            if kind == "cpu" && ptr < host_span.end && host_span.start < ptr.saturating_add(len) {
                return Err(Error::arg(
                    "device_layers",
                    format!("[{i}] overlaps the host buffer it would be copied to or from"),
                )
                .into());
            }
            kinds.insert(kind);
            rows = rows.min(len / row_bytes);
            device.push(RawRange { ptr, len });
            owners.push(t.clone());
            owners.push(t.call_method0("untyped_storage")?);
        }
        if kinds.len() > 1 {
            return Err(Error::arg("device_layers", "mixes CPU and CUDA tensors").into());
        }
        let cuda = kinds.contains("cuda");
        let req = Request {
            geo,
            host: RawRange {
                ptr: region.as_ptr() as usize + host_offset,
                len: geo.nbytes(),
            },
            device,
            h: indices(py, "host_indices", host_indices)?,
            d: indices(py, "device_indices", device_indices)?,
            rules: rules(slots, rows, page_size, host_pages, device_runs, to_host),
            layers: layer_begin..layer_end,
            dir: if to_host {
                Direction::DeviceToHost
            } else {
                Direction::HostToDevice
            },
            host_offset,
            _region: region,
        };
        let chunks = py.detach(|| req.plan(split.max(1)))?;
        let layer_start = (req.layers.start..=req.layers.end)
            .map(|l| chunks.partition_point(|c| (c.layer as usize) < l))
            .collect();
        let owners = pyo3::types::PyList::new(py, owners)?.into_any().unbind();
        Ok(Self {
            req,
            chunks,
            layer_start,
            _owners: owners,
            cuda,
        })
    }

    /// Copy layers `[layer_begin, layer_end)` now with CPU `memcpy` (CPU device tensors), GIL released.
    fn copy_cpu(&self, py: Python<'_>, layer_begin: usize, layer_end: usize) -> KvResult<()> {
        if self.cuda {
            return Err(Error::arg(
                "plan",
                "made for CUDA tensors: submit it to a stream instead of copy_cpu",
            )
            .into());
        }
        let part = self.slice(layer_begin, layer_end)?;
        let req = &self.req;
        // `req.host` is inside the live region (Arc held by `req`); each device range is the memory of a
        // contiguous CPU tensor whose storage `_owners` holds (checked in `new`, with `cuda` false here);
        // `new` refused device ranges overlapping the region (a view of the host buffer is a CPU tensor
        // too), so source and destination never overlap; copy_cpu re-checks every chunk against both.
        // SAFETY: chunks are re-checked against the live host region and CPU tensors.
        py.detach(|| unsafe { plan::copy_cpu(req.dir, req.host, &req.device, part) })?;
        Ok(())
    }
}

impl PyTransferPlan {
    fn slice(&self, layer_begin: usize, layer_end: usize) -> KvResult<&[plan::Chunk]> {
        let r = &self.req.layers;
        if layer_begin < r.start || layer_end > r.end || layer_begin >= layer_end {
            return Err(Error::arg(
                "layer_id",
                format!(
                    "layers [{layer_begin}, {layer_end}) not in the plan's [{}, {})",
                    r.start, r.end
                ),
            )
            .into());
        }
        Ok(&self.chunks
            [self.layer_start[layer_begin - r.start]..self.layer_start[layer_end - r.start]])
    }
}

/// Checks `events`: empty, or one live event per (group, lane), group-major.
fn check_events(events: &[usize], groups: usize, lanes: usize) -> KvResult<()> {
    if !events.is_empty() && events.len() != groups * lanes {
        return Err(Error::arg(
            "events",
            format!(
                "need one per layer and lane ({groups} x {lanes}), got {}",
                events.len()
            ),
        )
        .into());
    }
    if events.contains(&0) {
        return Err(Error::arg(
            "events",
            "an event handle is 0 (record a torch event once to create it)",
        )
        .into());
    }
    Ok(())
}

fn check_sides(stream: usize, sides: &[usize]) -> KvResult<()> {
    if sides.iter().any(|&s| s == 0 || s == stream)
        || (1..sides.len()).any(|i| sides[..i].contains(&sides[i]))
    {
        return Err(Error::arg(
            "side_streams",
            "must be distinct non-default streams other than `stream`",
        )
        .into());
    }
    Ok(())
}

/// One group of work (a layer, or all layers at once): one part per plan or launch (part i runs on lane
/// i % lanes), then the group's events, one per lane, recorded on that lane's stream.
struct Group<T> {
    parts: Vec<T>,
    events: Vec<usize>,
}

/// Enqueues `groups` on `stream` and the side streams (forked from `stream` once at the start and joined
/// back at the end, so `stream` orders everything), after `stream` waits for `after` (an event, 0 = none),
/// calling `before(g)` ahead of group g and `recorded` after each group's events.
///
/// On an error, whatever was already enqueued is waited for (the lanes joined and the streams synchronized)
/// before the error is returned: a caller that sees an error has nothing of this call left in flight.
#[allow(clippy::too_many_arguments)]
fn run_groups<T>(
    device: i32,
    stream: usize,
    sides: &[usize],
    after: usize,
    groups: &mut [Group<T>],
    recorded: &dyn Fn(),
    mut before: impl FnMut(&kvtier_core::cuda::Current, usize) -> kvtier_core::Result<()>,
    mut enqueue: impl FnMut(&kvtier_core::cuda::Current, usize, &mut T) -> kvtier_core::Result<()>,
) -> kvtier_core::Result<()> {
    let cur = kvtier_core::cuda::make_current(device)?;
    // SAFETY: the caller passes live streams of this device (checked distinct by `check_sides`).
    let lanes = unsafe { kvtier_core::cuda::Lanes::new(&cur, stream, sides)? };
    let mut body = || -> kvtier_core::Result<()> {
        if after != 0 {
            // SAFETY: the caller passes a live event of this device.
            unsafe { cur.stream_wait(stream, after)? };
        }
        lanes.fork()?;
        for (gi, g) in groups.iter_mut().enumerate() {
            before(&cur, gi)?;
            for (i, part) in g.parts.iter_mut().enumerate() {
                enqueue(&cur, lanes.stream(i), part)?;
            }
            for (lane, &ev) in g.events.iter().enumerate() {
                // SAFETY: the caller passes live events of this device.
                unsafe { cur.record_event(ev, lanes.stream(lane))? };
            }
            if !g.events.is_empty() {
                recorded();
            }
        }
        Ok(())
    };
    let res = body();
    let joined = lanes.join();
    if res.is_err() || joined.is_err() {
        for &s in std::iter::once(&stream).chain(sides) {
            // SAFETY: live streams (see above); errors here change nothing about the error we return.
            let _ = unsafe { cur.stream_synchronize(s) };
        }
    }
    res.and(joined)
}

type Copies = Vec<(usize, usize, usize)>;

fn build_groups(
    plans: &[PyRef<'_, PyTransferPlan>],
    layer_begin: usize,
    layer_end: usize,
    per_layer: bool,
    lanes: usize,
    events: &[usize],
) -> KvResult<Vec<Group<Copies>>> {
    if let Some(i) = plans.iter().position(|p| !p.cuda) {
        return Err(Error::arg(
            "plans",
            format!("[{i}] was made for CPU tensors: the copy engine needs CUDA device tensors"),
        )
        .into());
    }
    let groups = if per_layer {
        layer_end.saturating_sub(layer_begin)
    } else {
        1
    };
    check_events(events, groups, lanes)?;
    let mut out = Vec::with_capacity(groups);
    for g in 0..groups {
        let (lo, hi) = if per_layer {
            (layer_begin + g, layer_begin + g + 1)
        } else {
            (layer_begin, layer_end)
        };
        let mut parts = Vec::with_capacity(plans.len());
        for p in plans {
            parts.push(plan::addresses(
                p.req.dir,
                p.req.host,
                &p.req.device,
                p.slice(lo, hi)?,
            ));
        }
        let events = if events.is_empty() {
            Vec::new()
        } else {
            events[g * lanes..(g + 1) * lanes].to_vec()
        };
        out.push(Group { parts, events });
    }
    Ok(out)
}

/// Copies a background submission lets the driver queue ahead of the copy engine. Past a few thousand
/// pending copies `cuMemcpyBatchAsync` blocks inside the driver until the engine catches up (measured: 26 ms
/// of a 39 ms LayerLoader load), so the submitter waits on an earlier layer's events itself before it queues
/// more; 0 = no limit (synchronous submissions, whose caller waits anyway).
const MAX_AHEAD_COPIES: usize = 4096;

#[allow(clippy::too_many_arguments)]
fn copy_groups(
    device: i32,
    stream: usize,
    sides: &[usize],
    after: usize,
    batch: bool,
    groups: &mut [Group<Copies>],
    recorded: &dyn Fn(),
    max_ahead: usize,
) -> kvtier_core::Result<(usize, usize)> {
    let (mut copies, mut calls) = (0, 0);
    let sizes: Vec<(Vec<usize>, usize)> = groups
        .iter()
        .map(|g| (g.events.clone(), g.parts.iter().map(Vec::len).sum()))
        .collect();
    // (events of a submitted group, its copies), oldest first
    let mut pending: std::collections::VecDeque<(Vec<usize>, usize)> =
        std::collections::VecDeque::new();
    let mut ahead = 0usize;
    let before = |cur: &kvtier_core::cuda::Current, gi: usize| -> kvtier_core::Result<()> {
        let (events, n) = &sizes[gi];
        if max_ahead == 0 || events.is_empty() {
            return Ok(());
        }
        while ahead + n > max_ahead {
            let Some((old, m)) = pending.pop_front() else {
                break;
            };
            for &ev in &old {
                // live events of this device, recorded by this submission; the caller keeps them alive
                // and does not re-record them until the submission has finished.
                // SAFETY: events of this submission: live, and not re-recorded meanwhile.
                unsafe { cur.event_synchronize(ev)? };
            }
            ahead -= m;
        }
        pending.push_back((events.clone(), *n));
        ahead += n;
        Ok(())
    };
    run_groups(
        device,
        stream,
        sides,
        after,
        groups,
        recorded,
        before,
        |cur, lane, part| {
            // the addresses were checked against the live host regions and device tensors when the plans
            // were built; the caller keeps both alive until `stream` has passed the copies (for a background
            // submission: until it has finished and its last events have completed).
            // SAFETY: addresses validated when the plans were built; buffers kept alive.
            let sub = unsafe { cur.copy_async(lane, part, batch)? };
            copies += sub.copies;
            calls += sub.batch_calls;
            Ok(())
        },
    )?;
    Ok((copies, calls))
}

/// Enqueues layers `[layer_begin, layer_end)` of every plan in `plans` on CUDA `stream` of `device`, each
/// plan's copies as their own batch (K and V stay separate submissions); plan i goes to lane i mod (1 +
/// `side_streams`), the side streams forking from `stream` first and joining back at the end. With
/// `per_layer`, layer by layer, recording after each layer one event per lane (`events`, layer-major, when
/// not empty) on that lane's stream; without it, each plan's copies of all the layers in one submission
/// (`events` must be empty). GIL released, one context switch for the whole call. Returns
/// `(copies, batch_calls)`. The caller keeps host buffers and device tensors alive until `stream` passes
/// the copies, and passes live CUDA events (`torch.cuda.Event.cuda_event`) and streams of that device.
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
    check_sides(stream, &side_streams)?;
    if !per_layer && !events.is_empty() {
        return Err(Error::arg("events", "per-layer events need per_layer=True").into());
    }
    let mut groups = build_groups(
        &plans,
        layer_begin,
        layer_end,
        per_layer,
        1 + side_streams.len(),
        &events,
    )?;
    Ok(py.detach(|| {
        copy_groups(
            device,
            stream,
            &side_streams,
            0,
            batch,
            &mut groups,
            &|| {},
            0,
        )
    })?)
}

#[derive(Default)]
struct Progress {
    recorded: usize,
    done: bool,
    error: Option<kvtier_core::Error>,
}

/// A per-layer submission running on a native thread (see `submit_layers_background`).
#[pyclass(name = "Submission", module = "kvtier._native", frozen)]
pub struct PySubmission {
    state: std::sync::Arc<(std::sync::Mutex<Progress>, std::sync::Condvar)>,
    groups: usize,
}

impl PySubmission {
    fn wait_until(
        &self,
        py: Python<'_>,
        enough: impl Fn(&Progress) -> bool + Send + Sync,
    ) -> KvResult<()> {
        let state = self.state.clone();
        py.detach(move || {
            let (m, cv) = &*state;
            let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
            while !enough(&g) && !g.done {
                g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            match &g.error {
                Some(kvtier_core::Error::Cuda { call, code, detail }) => {
                    Err(kvtier_core::Error::Cuda {
                        call,
                        code: *code,
                        detail: detail.clone(),
                    })
                }
                Some(e) => Err(kvtier_core::Error::CudaUnavailable(format!(
                    "background submission failed: {e}"
                ))),
                None => Ok(()),
            }
        })?;
        Ok(())
    }
}

#[pymethods]
impl PySubmission {
    /// Blocks (GIL released) until the events of layer `index` (0-based within the submission) have been
    /// recorded; raises the submission's error if it failed first.
    fn wait_recorded(&self, py: Python<'_>, index: usize) -> KvResult<()> {
        if index >= self.groups {
            return Err(
                Error::arg("index", format!("must be < {}, got {index}", self.groups)).into(),
            );
        }
        self.wait_until(py, move |p| p.recorded > index)
    }
    /// Blocks (GIL released) until every copy has been submitted; raises the submission's error if any.
    fn join(&self, py: Python<'_>) -> KvResult<()> {
        self.wait_until(py, |p| p.done)
    }
    /// True once every copy has been submitted (or the submission failed).
    fn finished(&self) -> bool {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner()).done
    }
}

/// As `submit_layers` with `per_layer=True`, but submitted by a native thread, so that a caller whose copies
/// outrun the driver's queue (it blocks inside the submitting call once thousands of copies are pending) is
/// not held up: LayerLoader returns at once and its compute thread keeps launching. The thread first waits
/// until `previous` (the last background submission on the same stream, if any) has finished submitting, so
/// submissions reach the stream in call order, then makes the stream wait for `after` (an event, 0 = none).
/// Returns a `Submission`; wait on `wait_recorded(i)` before making a stream wait on layer i's events. The
/// caller keeps `after`, the events and the device tensors alive until `finished()` and the last events have
/// completed; the thread itself keeps the host buffers mapped until it is done. On an error the thread waits
/// for everything it enqueued before it reports `finished()`.
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
    check_sides(stream, &side_streams)?;
    if events.is_empty() {
        return Err(Error::arg(
            "events",
            "a background submission needs events for every layer",
        )
        .into());
    }
    let mut groups = build_groups(
        &plans,
        layer_begin,
        layer_end,
        true,
        1 + side_streams.len(),
        &events,
    )?;
    let regions: Vec<_> = plans.iter().map(|p| p.req._region.clone()).collect();
    let previous = previous.map(|p| p.state.clone());
    let n = groups.len();
    let state = std::sync::Arc::new((
        std::sync::Mutex::new(Progress::default()),
        std::sync::Condvar::new(),
    ));
    let worker = state.clone();
    std::thread::Builder::new()
        .name("kvtier-submit".into())
        .spawn(move || {
            let _regions = regions; // host memory stays mapped while this thread may submit copies of it
            if let Some(prev) = previous {
                let (m, cv) = &*prev;
                let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
                while !g.done {
                    g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
            }
            let (m, cv) = &*worker;
            let bump = || {
                m.lock().unwrap_or_else(|p| p.into_inner()).recorded += 1;
                cv.notify_all();
            };
            let res = copy_groups(
                device,
                stream,
                &side_streams,
                after,
                batch,
                &mut groups,
                &bump,
                MAX_AHEAD_COPIES,
            );
            let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
            g.done = true;
            g.error = res.err();
            cv.notify_all();
        })
        .map_err(|e| Error::Os {
            what: "spawning the submission thread".into(),
            source: e,
        })?;
    Ok(PySubmission { state, groups: n })
}

/// Enqueues compiled-kernel launches for layers `[layer_begin, layer_end)`: for each layer, every launch of
/// `launches` with its parameter `layer_param` set to the layer (launch i on lane i mod (1 +
/// `side_streams`), as in `submit_layers`), then the layer's events, one per lane (when given). Each launch
/// is `(function, grid, block, shared_bytes, widths, values, layer_param)`: `widths[i]` is 4 or 8, the byte
/// width of parameter i. GIL released, one context switch for the whole call.
///
/// Private to `kvtier.kernels`, which passes only functions it compiled, whose parameter list it checked
/// against the compiled code, and addresses of buffers it validated and keeps alive.
#[pyfunction]
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
) -> KvResult<()> {
    use kvtier_core::cuda::{Kernel, Param};
    check_sides(stream, &side_streams)?;
    let n_groups = layer_end.saturating_sub(layer_begin);
    let lanes = 1 + side_streams.len();
    check_events(&events, n_groups, lanes)?;
    if layer_end > u32::MAX as usize {
        return Err(Error::arg("layer_end", format!("too large: {layer_end}")).into());
    }
    let mut prepared = Vec::with_capacity(launches.len());
    for (i, (function, grid, block, shared, widths, values, layer_param)) in
        launches.into_iter().enumerate()
    {
        if widths.len() != values.len() || layer_param >= widths.len() || widths[layer_param] != 4 {
            return Err(Error::arg(
                "launches",
                format!(
                    "launch {i}: {} widths, {} values, layer parameter {layer_param}",
                    widths.len(),
                    values.len()
                ),
            )
            .into());
        }
        let mut params = Vec::with_capacity(values.len());
        for (j, (&w, &v)) in widths.iter().zip(&values).enumerate() {
            params.push(match w {
                4 => Param::U32(u32::try_from(v).map_err(|_| {
                    Error::arg(
                        "launches",
                        format!("launch {i} parameter {j}: {v} does not fit 32 bits"),
                    )
                })?),
                8 => Param::U64(v),
                _ => {
                    return Err(Error::arg(
                        "launches",
                        format!("launch {i} parameter {j}: width {w} is not 4 or 8"),
                    )
                    .into())
                }
            });
        }
        prepared.push((
            Kernel {
                function,
                grid,
                block,
                shared,
            },
            params,
            layer_param,
        ));
    }
    let mut groups: Vec<Group<(u32, usize)>> = (0..n_groups)
        .map(|g| Group {
            parts: (0..prepared.len())
                .map(|i| ((layer_begin + g) as u32, i))
                .collect(),
            events: if events.is_empty() {
                Vec::new()
            } else {
                events[g * lanes..(g + 1) * lanes].to_vec()
            },
        })
        .collect();
    py.detach(|| {
        run_groups(
            device,
            stream,
            &side_streams,
            0,
            &mut groups,
            &|| {},
            |_, _| Ok(()),
            |cur, lane, &mut (layer, i)| {
                let (kernel, params, layer_param) = &mut prepared[i];
                params[*layer_param] = Param::U32(layer);
                // kvtier.kernels (the only caller) passes a function it compiled in this context, whose
                // parameter widths it read from the compiled code, and addresses of validated buffers and index
                // tensors it keeps alive until `stream` (which joins every lane) has passed the launch.
                // SAFETY: a function compiled in this context, parameter widths checked.
                unsafe { cur.launch(lane, kernel, params) }
            },
        )
    })?;
    Ok(())
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

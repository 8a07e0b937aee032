//! The transfer engine: validated, planned copies of one host buffer (a K or a V side) to and from a list
//! of device layer tensors, executed with CPU `memcpy` or submitted to CUDA streams (copy engine, or
//! compiled kernels), layer by layer with events, synchronously or from a background thread.
//!
//! - [`Plan`]: indices validated once, chunks planned once and checked against both buffers; reused for
//!   every layer of a per-layer load.
//! - [`submit_layers`] / [`submit_layers_background`] ([`Submission`]): the copy engine, with lanes (side
//!   streams forked from the caller's and joined back), per-layer events, and flow control.
//! - [`launch_layers`]: compiled kernels, layer by layer, on the same lanes and events.
//!
//! The binding converts Python arguments into these types and releases the GIL; it holds the Python
//! objects (device tensors, events) alive as the contracts below say.

mod groups;
mod launch;
mod submission;
#[cfg(test)]
mod tests;

pub use groups::{submit_layers, submit_layers_detour, MAX_AHEAD_COPIES};
pub use launch::{launch_layers, KernelLaunch};
pub use submission::{submit_gate_background, submit_layers_background, Submission};

use std::ops::Range;
use std::sync::Arc;

use crate::buffer::HostRegion;
use crate::plan::{self, Chunk, Direction, HostGeometry, IndexRules, RawRange};
use crate::{Error, Result};

/// A validated, planned copy of one side (K or V) for a fixed index pair: the chunks of every layer in
/// `layers`, each checked to lie inside the host buffer and its layer's device range.
pub struct Plan {
    dir: Direction,
    host: RawRange,
    device: Vec<RawRange>,
    layers: Range<usize>,
    /// Every chunk, in layer order (`plan::plan` emits them layer by layer).
    chunks: Vec<Chunk>,
    /// `chunks[layer_start[i]..layer_start[i + 1]]` are the chunks of layer `layers.start + i`.
    layer_start: Vec<usize>,
    /// Whether the device ranges are CUDA memory (copy engine) or CPU memory (`copy_cpu`).
    cuda: bool,
    region: Arc<HostRegion>,
}

/// What a [`Plan`] copies: the host buffer (a range of `region` at `host_offset`, laid out as `geo`), the
/// device layer ranges, the indices and their rules, the layers, the direction.
pub struct PlanRequest {
    /// The host side's geometry.
    pub geo: HostGeometry,
    /// The mapping the host side lives in (kept alive by the plan).
    pub region: Arc<HostRegion>,
    /// Byte offset of the host side inside `region`.
    pub host_offset: usize,
    /// One range per layer: the device tensor's memory (CPU or CUDA, see `cuda`).
    pub device: Vec<RawRange>,
    /// Whether `device` is CUDA memory.
    pub cuda: bool,
    /// Host token slots.
    pub host_indices: Vec<i64>,
    /// Device rows.
    pub device_indices: Vec<i64>,
    /// The index rules (pages, distinct destinations, bounds).
    pub rules: IndexRules,
    /// Layers planned.
    pub layers: Range<usize>,
    /// Direction.
    pub dir: Direction,
    /// No chunk crosses a multiple of this many host bytes from the region's start (CUDA registrations).
    pub split: usize,
}

impl Plan {
    /// Validates the indices, plans the chunks and checks each against both buffers.
    pub fn new(r: PlanRequest) -> Result<Self> {
        Self::check_disjoint(std::slice::from_ref(&r))?;
        Self::build(r, true)
    }

    /// CPU device memory must not overlap any host region of the transfer (its own side's, or — for a pool
    /// whose K and V live in two host buffers — the other side's): the copy would read or write host memory
    /// as device memory.
    fn check_disjoint(reqs: &[PlanRequest]) -> Result<()> {
        for r in reqs.iter().filter(|r| !r.cuda) {
            for (i, d) in r.device.iter().enumerate() {
                let hit = reqs.iter().any(|o| {
                    let start = o.region.as_ptr() as usize;
                    d.ptr < start + o.region.len() && start < d.ptr.saturating_add(d.len)
                });
                if hit {
                    return Err(Error::arg(
                        "device_layers",
                        format!("[{i}] overlaps the host buffer of this transfer's K or V"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `validate`: check the indices against the rules (skipped only by `new_sides` for a request whose
    /// indices and rules equal those of one it has validated). Chunks are always checked against both
    /// buffers, so no address outside them is ever planned.
    fn build(r: PlanRequest, validate: bool) -> Result<Self> {
        if r.host_offset
            .checked_add(r.geo.nbytes())
            .is_none_or(|end| end > r.region.len())
        {
            return Err(Error::arg(
                "size",
                format!(
                    "geometry needs {} bytes at offset {}, buffer has {}",
                    r.geo.nbytes(),
                    r.host_offset,
                    r.region.len()
                ),
            ));
        }
        if r.layers.start >= r.layers.end || r.layers.end > r.device.len() {
            return Err(Error::arg(
                "layer_id",
                format!(
                    "layers [{}, {}) not in [0, {})",
                    r.layers.start,
                    r.layers.end,
                    r.device.len()
                ),
            ));
        }
        let host = RawRange {
            ptr: r.region.as_ptr() as usize + r.host_offset,
            len: r.geo.nbytes(),
        };
        if validate {
            plan::validate(&r.host_indices, &r.device_indices, &r.rules)?;
        }
        let chunks = plan::plan(
            &r.geo,
            &r.host_indices,
            &r.device_indices,
            r.layers.clone(),
            r.split.max(1),
            r.host_offset,
        );
        plan::check_chunks(host, &r.device, &chunks)?;
        let layer_start = (r.layers.start..=r.layers.end)
            .map(|l| chunks.partition_point(|c| (c.layer as usize) < l))
            .collect();
        Ok(Plan {
            dir: r.dir,
            host,
            device: r.device,
            layers: r.layers,
            chunks,
            layer_start,
            cuda: r.cuda,
            region: r.region,
        })
    }

    /// Plans several sides (a pool's K and V) of one transfer: the indices are validated once when every
    /// request carries the same indices, rules and layers (checked here, element by element: a cheap
    /// comparison next to the validation it saves), else each request is validated on its own.
    /// CPU device memory is checked against every side's host region ([`Plan::check_disjoint`]).
    pub fn new_sides(reqs: Vec<PlanRequest>) -> Result<Vec<Self>> {
        Self::check_disjoint(&reqs)?;
        let shared = reqs.windows(2).all(|w| {
            w[0].host_indices == w[1].host_indices
                && w[0].device_indices == w[1].device_indices
                && w[0].rules == w[1].rules
                && w[0].layers == w[1].layers
        });
        let mut out = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.into_iter().enumerate() {
            out.push(Self::build(r, !shared || i == 0)?);
        }
        Ok(out)
    }

    /// Whether the plan's device side is CUDA memory.
    pub fn cuda(&self) -> bool {
        self.cuda
    }

    /// The chunks of layers `[layer_begin, layer_end)`.
    pub fn slice(&self, layer_begin: usize, layer_end: usize) -> Result<&[Chunk]> {
        let r = &self.layers;
        if layer_begin < r.start || layer_end > r.end || layer_begin >= layer_end {
            return Err(Error::arg(
                "layer_id",
                format!(
                    "layers [{layer_begin}, {layer_end}) not in the plan's [{}, {})",
                    r.start, r.end
                ),
            ));
        }
        Ok(&self.chunks
            [self.layer_start[layer_begin - r.start]..self.layer_start[layer_end - r.start]])
    }

    /// `(source, destination, len)` addresses of layers `[layer_begin, layer_end)`.
    pub fn addresses(
        &self,
        layer_begin: usize,
        layer_end: usize,
    ) -> Result<Vec<(usize, usize, usize)>> {
        Ok(plan::addresses(
            self.dir,
            self.host,
            &self.device,
            self.slice(layer_begin, layer_end)?,
        ))
    }

    /// The host mapping (kept alive by whoever submits the plan's copies asynchronously).
    pub fn region(&self) -> &Arc<HostRegion> {
        &self.region
    }

    /// Copies layers `[layer_begin, layer_end)` now with CPU `memcpy`, re-checking every chunk.
    ///
    /// # Safety
    /// The device ranges must be live CPU memory for the whole call, as they were when the plan was made
    /// (the caller holds the tensors that own them), and must not overlap the host region.
    pub unsafe fn copy_cpu(&self, layer_begin: usize, layer_end: usize) -> Result<()> {
        if self.cuda {
            return Err(Error::arg(
                "plan",
                "made for CUDA tensors: submit it to a stream instead of copy_cpu",
            ));
        }
        let part = self.slice(layer_begin, layer_end)?;
        // the host range is inside the live region (held by this plan); the device ranges are the caller's
        // live CPU memory, disjoint from the region (caller contract); copy_cpu re-checks every chunk.
        // SAFETY: the caller upholds this function's contract; chunks are re-checked in bounds.
        unsafe { plan::copy_cpu(self.dir, self.host, &self.device, part) }
    }
}

/// Where [`plan_and_run`] runs the plans it has just made.
pub enum Run<'a> {
    /// CPU `memcpy` of `layers` (plans of CPU device tensors).
    Cpu {
        /// Layers copied.
        layers: Range<usize>,
    },
    /// [`submit_layers`] of `layers` on CUDA `stream` of `device`, with its lanes, batching and events.
    Cuda {
        /// Layers submitted.
        layers: Range<usize>,
        /// CUDA device ordinal.
        device: i32,
        /// The caller's stream.
        stream: usize,
        /// Side streams (lanes) forked from `stream` and joined back.
        side_streams: &'a [usize],
        /// Whether copies go through `cuMemcpyBatchAsync`.
        batch: bool,
        /// Layer by layer, with `events`.
        per_layer: bool,
        /// One event per lane and layer (`per_layer` only).
        events: &'a [usize],
    },
}

/// Plans the sides of one transfer ([`Plan::new_sides`]: the indices validated once) and runs their first
/// copies in the same call, so a transfer with new indices costs its caller one crossing, like a transfer
/// that reuses its plans. Returns the plans (for later layers or repeated transfers) and `(copies,
/// batch_calls)` of a CUDA run (`(0, 0)` for CPU). Nothing is copied unless every side planned.
///
/// # Safety
/// For [`Run::Cpu`], [`Plan::copy_cpu`]'s contract; for [`Run::Cuda`], [`submit_layers`]' (the caller keeps
/// the device memory alive until the stream has passed the copies).
pub unsafe fn plan_and_run(
    reqs: Vec<PlanRequest>,
    run: Run<'_>,
) -> Result<(Vec<Plan>, (usize, usize))> {
    let plans = Plan::new_sides(reqs)?;
    let refs: Vec<&Plan> = plans.iter().collect();
    let counts = match run {
        Run::Cpu { layers } => {
            for p in &refs {
                // SAFETY: this function's contract (Plan::copy_cpu's), passed on by the caller.
                unsafe { p.copy_cpu(layers.start, layers.end)? };
            }
            (0, 0)
        }
        Run::Cuda {
            layers,
            device,
            stream,
            side_streams,
            batch,
            per_layer,
            events,
        } => submit_layers(
            &refs,
            layers.start,
            layers.end,
            device,
            stream,
            side_streams,
            batch,
            per_layer,
            events,
        )?,
    };
    Ok((plans, counts))
}

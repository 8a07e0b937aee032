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

pub use groups::{submit_layers, MAX_AHEAD_COPIES};
pub use launch::{launch_layers, KernelLaunch};
pub use submission::{submit_layers_background, Submission};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::Kernel;
    use crate::plan::Layout;

    fn request(
        region: Arc<HostRegion>,
        device: &mut [Vec<u8>],
        h: Vec<i64>,
        d: Vec<i64>,
        to_host: bool,
    ) -> PlanRequest {
        // page_first_direct, 2 layers, 4 slots of 2-token pages, 8-byte rows
        let geo = HostGeometry::new(Layout::PageFirstDirect, 2, 4, 2, 8).unwrap();
        PlanRequest {
            geo,
            region,
            host_offset: 0,
            device: device
                .iter_mut()
                .map(|v| RawRange {
                    ptr: v.as_mut_ptr() as usize,
                    len: v.len(),
                })
                .collect(),
            cuda: false,
            host_indices: h,
            device_indices: d,
            rules: IndexRules {
                host_slots: 4,
                device_rows: 6,
                page_size: 2,
                host_pages: true,
                device_runs: true,
                destination_is_host: to_host,
            },
            layers: 0..2,
            dir: if to_host {
                Direction::DeviceToHost
            } else {
                Direction::HostToDevice
            },
            split: usize::MAX,
        }
    }

    #[test]
    fn plan_round_trip_on_cpu_and_bad_input_is_refused_before_a_byte_moves() {
        let region = Arc::new(HostRegion::new(4096, &Default::default()).unwrap());
        let mut device: Vec<Vec<u8>> = (0..2u8)
            .map(|l| (0..48).map(|i| i ^ (l * 100)).collect())
            .collect();
        let orig = device.clone();
        let backup = Plan::new(request(
            region.clone(),
            &mut device,
            vec![2, 3],
            vec![4, 5],
            true,
        ))
        .unwrap();
        // SAFETY: `device` is live CPU memory disjoint from the region for the whole call.
        unsafe { backup.copy_cpu(0, 2).unwrap() };
        for v in device.iter_mut() {
            v.fill(0);
        }
        let load = Plan::new(request(
            region.clone(),
            &mut device,
            vec![2, 3],
            vec![0, 1],
            false,
        ))
        .unwrap();
        // SAFETY: as above.
        unsafe { load.copy_cpu(0, 2).unwrap() };
        for l in 0..2 {
            assert_eq!(&device[l][0..16], &orig[l][32..48]);
            assert!(device[l][16..].iter().all(|&b| b == 0));
        }
        assert!(load.slice(1, 3).is_err() && load.slice(1, 1).is_err() && load.slice(0, 1).is_ok());
        // a host slot past the pool, a layer range past the tensors: refused at planning
        assert!(Plan::new(request(
            region.clone(),
            &mut device,
            vec![6, 7],
            vec![0, 1],
            false
        ))
        .is_err());
        let mut r = request(region.clone(), &mut device, vec![0, 1], vec![0, 1], false);
        r.layers = 0..3;
        assert!(Plan::new(r).is_err());
        // a plan for CPU memory is never handed to the copy engine
        let err = submit_layers(&[&load], 0, 2, 0, 7, &[], true, true, &[]).unwrap_err();
        assert!(err.to_string().contains("CPU tensors"), "{err}");
    }

    #[test]
    fn plan_and_run_copies_once_planned_and_nothing_when_a_side_is_refused() {
        let region = Arc::new(HostRegion::new(4096, &Default::default()).unwrap());
        let mut device: Vec<Vec<u8>> = (0..2u8)
            .map(|l| (0..48).map(|i| i ^ (l * 100)).collect())
            .collect();
        let orig = device.clone();
        let reqs = vec![request(
            region.clone(),
            &mut device,
            vec![2, 3],
            vec![4, 5],
            true,
        )];
        // SAFETY: `device` is live CPU memory disjoint from the region for the whole call.
        let (plans, counts) = unsafe { plan_and_run(reqs, Run::Cpu { layers: 0..2 }) }.unwrap();
        assert_eq!((plans.len(), counts), (1, (0, 0)));
        for v in device.iter_mut() {
            v.fill(0);
        }
        // the returned plan is reusable: a load through a second call copies the bytes back
        let reqs = vec![request(
            region.clone(),
            &mut device,
            vec![2, 3],
            vec![0, 1],
            false,
        )];
        // SAFETY: as above.
        let (load, _) = unsafe { plan_and_run(reqs, Run::Cpu { layers: 0..1 }) }.unwrap();
        assert_eq!(&device[0][0..16], &orig[0][32..48]);
        assert!(
            device[1].iter().all(|&b| b == 0),
            "only the layers asked for are copied"
        );
        // SAFETY: as above.
        unsafe { load[0].copy_cpu(1, 2).unwrap() };
        assert_eq!(&device[1][0..16], &orig[1][32..48]);
        // the second side's device rows are out of range: no side is copied
        let before = device.clone();
        let good = request(region.clone(), &mut device, vec![0, 1], vec![0, 1], false);
        let mut bad = request(region.clone(), &mut device, vec![0, 1], vec![0, 1], false);
        bad.device_indices = vec![6, 7];
        // SAFETY: as above.
        assert!(unsafe { plan_and_run(vec![good, bad], Run::Cpu { layers: 0..2 }) }.is_err());
        assert_eq!(device, before);
        // CPU plans are never handed to the copy engine, planned or not
        let reqs = vec![request(
            region.clone(),
            &mut device,
            vec![0, 1],
            vec![0, 1],
            false,
        )];
        let run = Run::Cuda {
            layers: 0..2,
            device: 0,
            stream: 7,
            side_streams: &[],
            batch: true,
            per_layer: false,
            events: &[],
        };
        // SAFETY: refused before any submission (CPU plans).
        let err = unsafe { plan_and_run(reqs, run) }.err().unwrap();
        assert!(err.to_string().contains("CPU tensors"), "{err}");
    }

    #[test]
    fn sides_are_validated_once_and_bad_input_still_refused() {
        let region = Arc::new(HostRegion::new(4096, &Default::default()).unwrap());
        let mut dev: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 48]).collect();
        let mut dev2 = dev.clone();
        let k = request(region.clone(), &mut dev, vec![0, 1], vec![2, 3], false);
        let mut v = request(region.clone(), &mut dev2, vec![0, 1], vec![2, 3], false);
        v.host_offset = 64;
        assert_eq!(Plan::new_sides(vec![k, v]).unwrap().len(), 2);
        // different indices per side: each validated, so a bad second side is refused
        let k = request(region.clone(), &mut dev, vec![0, 1], vec![2, 3], false);
        let v = request(region.clone(), &mut dev2, vec![0, 1], vec![3, 3], false); // not a page run
        assert!(Plan::new_sides(vec![k, v]).is_err());
        // duplicate destinations in the shared indices: refused by the one validation
        let k = request(
            region.clone(),
            &mut dev,
            vec![0, 1, 0, 1],
            vec![2, 3, 2, 3],
            false,
        );
        let v = request(region, &mut dev2, vec![0, 1, 0, 1], vec![2, 3, 2, 3], false);
        assert!(Plan::new_sides(vec![k, v]).is_err());
    }

    #[test]
    fn streams_events_and_launches_are_checked() {
        assert!(groups::check_sides(5, &[6, 7]).is_ok());
        assert!(groups::check_sides(5, &[5]).is_err() && groups::check_sides(5, &[0]).is_err());
        assert!(groups::check_sides(5, &[6, 6]).is_err());
        assert!(groups::check_events(&[1, 2, 3, 4], 2, 2).is_ok());
        assert!(
            groups::check_events(&[1, 2, 3], 2, 2).is_err()
                && groups::check_events(&[1, 0], 1, 2).is_err()
        );
        let k = Kernel {
            function: 1,
            grid: 1,
            block: 32,
            shared: 0,
        };
        assert!(KernelLaunch::new(0, k, &[8, 4], &[1, 2], 1).is_ok());
        assert!(KernelLaunch::new(0, k, &[8, 4], &[1, 1 << 40], 1).is_err()); // does not fit 32 bits
        assert!(KernelLaunch::new(0, k, &[8, 4], &[1, 2], 0).is_err()); // the layer is a 32-bit parameter
        assert!(KernelLaunch::new(0, k, &[8, 2], &[1, 2], 0).is_err()); // width 2
        assert!(KernelLaunch::new(0, k, &[8], &[1, 2], 0).is_err()); // counts differ
    }
}

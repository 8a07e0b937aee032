//! Groups of work (a layer, or all layers at once) on a caller's stream and its lanes, with events and
//! flow control; the copy engine's submission.

use super::Plan;
use crate::cuda::{self, Current, Lanes};
use crate::{Error, Result};

/// Copies a background submission lets the driver queue ahead of the copy engine. Past a few thousand
/// pending copies `cuMemcpyBatchAsync` blocks inside the driver until the engine catches up (measured: 26 ms
/// of a 39 ms LayerLoader load), so the submitter waits on an earlier layer's events itself before it queues
/// more; 0 = no limit (synchronous submissions, whose caller waits anyway).
pub const MAX_AHEAD_COPIES: usize = 4096;

/// Checks `events`: empty, or one live event per (group, lane), group-major.
pub(super) fn check_events(events: &[usize], groups: usize, lanes: usize) -> Result<()> {
    if !events.is_empty() && events.len() != groups * lanes {
        return Err(Error::arg(
            "events",
            format!(
                "need one per layer and lane ({groups} x {lanes}), got {}",
                events.len()
            ),
        ));
    }
    if events.contains(&0) {
        return Err(Error::arg(
            "events",
            "an event handle is 0 (record a torch event once to create it)",
        ));
    }
    Ok(())
}

/// Checks the side streams: distinct, non-default, and not the caller's stream.
pub(super) fn check_sides(stream: usize, sides: &[usize]) -> Result<()> {
    if sides.iter().any(|&s| s == 0 || s == stream)
        || (1..sides.len()).any(|i| sides[..i].contains(&sides[i]))
    {
        return Err(Error::arg(
            "side_streams",
            "must be distinct non-default streams other than `stream`",
        ));
    }
    Ok(())
}

/// One group of work (a layer, or all layers at once): one part per plan or launch (part i runs on lane
/// i % lanes), then the group's events, one per lane, recorded on that lane's stream.
pub(super) struct Group<T> {
    pub(super) parts: Vec<T>,
    pub(super) events: Vec<usize>,
}

/// Enqueues `groups` on `stream` and the side streams (forked from `stream` once at the start and joined
/// back at the end, so `stream` orders everything), after `stream` waits for `after` (an event, 0 = none),
/// calling `before(g)` ahead of group g and `recorded` after each group's events; then records `mark` (an
/// event, 0 = none) on `stream` after the join, where it follows everything this call enqueued.
///
/// On an error, whatever was already enqueued is waited for (the lanes joined and the streams synchronized)
/// before the error is returned: a caller that sees an error has nothing of this call left in flight.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_groups<T>(
    device: i32,
    stream: usize,
    sides: &[usize],
    after: usize,
    mark: usize,
    groups: &mut [Group<T>],
    recorded: &dyn Fn(),
    mut before: impl FnMut(&Current, usize) -> Result<()>,
    mut enqueue: impl FnMut(&Current, usize, &mut T) -> Result<()>,
) -> Result<()> {
    let cur = cuda::make_current(device)?;
    // SAFETY: the caller passes live streams of this device (checked distinct by `check_sides`).
    let lanes = unsafe { Lanes::new(&cur, stream, sides)? };
    let mut body = || -> Result<()> {
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
    let mut joined = lanes.join();
    if res.is_ok() && joined.is_ok() && mark != 0 {
        // SAFETY: the caller passes a live event of this device.
        joined = unsafe { cur.record_event(mark, stream) };
    }
    if res.is_err() || joined.is_err() {
        for &s in std::iter::once(&stream).chain(sides) {
            // SAFETY: live streams (see above); errors here change nothing about the error we return.
            let _ = unsafe { cur.stream_synchronize(s) };
        }
    }
    res.and(joined)
}

pub(super) type Copies = Vec<(usize, usize, usize)>;

/// The copies of `plans` for layers `[layer_begin, layer_end)`: one group per layer (`per_layer`) or one
/// for all, with `events` split per group and lane.
pub(super) fn build_groups(
    plans: &[&Plan],
    layer_begin: usize,
    layer_end: usize,
    per_layer: bool,
    lanes: usize,
    events: &[usize],
) -> Result<Vec<Group<Copies>>> {
    if let Some(i) = plans.iter().position(|p| !p.cuda()) {
        return Err(Error::arg(
            "plans",
            format!("[{i}] was made for CPU tensors: the copy engine needs CUDA device tensors"),
        ));
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
        let parts = plans
            .iter()
            .map(|p| p.addresses(lo, hi))
            .collect::<Result<Vec<_>>>()?;
        let events = if events.is_empty() {
            Vec::new()
        } else {
            events[g * lanes..(g + 1) * lanes].to_vec()
        };
        out.push(Group { parts, events });
    }
    Ok(out)
}

/// Submits `groups` of copies (see [`run_groups`]); with `max_ahead`, waits on an earlier group's events
/// before more than that many copies are queued. Returns `(copies, batch_calls)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn copy_groups(
    device: i32,
    stream: usize,
    sides: &[usize],
    after: usize,
    batch: bool,
    groups: &mut [Group<Copies>],
    recorded: &dyn Fn(),
    max_ahead: usize,
) -> Result<(usize, usize)> {
    let (mut copies, mut calls) = (0, 0);
    let sizes: Vec<(Vec<usize>, usize)> = groups
        .iter()
        .map(|g| (g.events.clone(), g.parts.iter().map(Vec::len).sum()))
        .collect();
    // (events of a submitted group, its copies), oldest first
    let mut pending: std::collections::VecDeque<(Vec<usize>, usize)> =
        std::collections::VecDeque::new();
    let mut ahead = 0usize;
    let before = |cur: &Current, gi: usize| -> Result<()> {
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
        0,
        groups,
        recorded,
        before,
        |cur, lane, part| {
            // the addresses were checked against the live host regions and device tensors when the plans were
            // built; the caller keeps both alive until `stream` has passed the copies (for a background
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

/// Enqueues layers `[layer_begin, layer_end)` of every plan on CUDA `stream` of `device`, each plan's copies
/// as their own batch (K and V stay separate submissions); plan i goes to lane i mod (1 + `side_streams`),
/// the side streams forking from `stream` first and joining back at the end. With `per_layer`, layer by
/// layer, recording after each layer one event per lane (`events`, layer-major, when not empty) on that
/// lane's stream; without it, each plan's copies of all the layers in one submission (`events` must be
/// empty). Returns `(copies, batch_calls)`.
///
/// The caller keeps the plans' device memory alive until `stream` passes the copies (the plans hold the host
/// mappings), and passes live CUDA events and streams of that device.
#[allow(clippy::too_many_arguments)]
pub fn submit_layers(
    plans: &[&Plan],
    layer_begin: usize,
    layer_end: usize,
    device: i32,
    stream: usize,
    side_streams: &[usize],
    batch: bool,
    per_layer: bool,
    events: &[usize],
) -> Result<(usize, usize)> {
    check_sides(stream, side_streams)?;
    if !per_layer && !events.is_empty() {
        return Err(Error::arg("events", "per-layer events need per_layer=True"));
    }
    let mut groups = build_groups(
        plans,
        layer_begin,
        layer_end,
        per_layer,
        1 + side_streams.len(),
        events,
    )?;
    copy_groups(
        device,
        stream,
        side_streams,
        0,
        batch,
        &mut groups,
        &|| {},
        0,
    )
}

/// [`submit_layers`] (no lanes, no per-layer events) for a caller on a default stream, which the batch API
/// refuses: `caller` records `fork`, `detour` waits for it and takes the copies of layers
/// `[layer_begin, layer_end)`, then records `join`; `caller` waits for `join`, then records `mark` (0 = none),
/// which then follows the copies. One call for what the Python detour (`kvtier.transfer.streams`) does in
/// five event operations. Returns `(copies, batch_calls)`. On an error, nothing of this call is left in
/// flight (the detour synchronized).
#[allow(clippy::too_many_arguments)]
pub fn submit_layers_detour(
    plans: &[&Plan],
    layer_begin: usize,
    layer_end: usize,
    device: i32,
    caller: usize,
    detour: usize,
    fork: usize,
    join: usize,
    batch: bool,
    mark: usize,
) -> Result<(usize, usize)> {
    if detour == 0 || detour == caller {
        return Err(Error::arg(
            "detour",
            "must be a non-default stream other than the caller's",
        ));
    }
    if fork == 0 || join == 0 || fork == join {
        return Err(Error::arg(
            "fork/join",
            "two distinct live events are needed (record a torch event once to create it)",
        ));
    }
    let mut groups = build_groups(plans, layer_begin, layer_end, false, 1, &[join])?;
    {
        let cur = cuda::make_current(device)?;
        // SAFETY: the caller passes a live event and a live stream of this device.
        unsafe { cur.record_event(fork, caller)? };
    }
    // the detour waits for `fork`, takes the copies and records `join` after them (the group's event)
    let done = copy_groups(device, detour, &[], fork, batch, &mut groups, &|| {}, 0)?;
    let cur = cuda::make_current(device)?;
    // SAFETY: live streams and events of this device (as above).
    let mut res = unsafe { cur.stream_wait(caller, join) };
    if res.is_ok() && mark != 0 {
        // SAFETY: as above.
        res = unsafe { cur.record_event(mark, caller) };
    }
    if res.is_err() {
        // SAFETY: a live stream (as above); the error returned is the first one.
        let _ = unsafe { cur.stream_synchronize(detour) };
    }
    res.map(|()| done)
}

//! Per-layer copy submissions run by a native thread, so a caller whose copies outrun the driver's queue
//! is not held up.

use std::sync::{Arc, Condvar, Mutex};

use super::groups::{build_groups, check_sides, copy_groups, MAX_AHEAD_COPIES};
use super::Plan;
use crate::{Error, Result};

#[derive(Default)]
struct Progress {
    recorded: usize,
    done: bool,
    error: Option<Error>,
}

type State = Arc<(Mutex<Progress>, Condvar)>;

/// Blocks until the submission behind `state` (if any) has finished submitting.
fn wait_done(state: Option<&State>) {
    if let Some(state) = state {
        let (m, cv) = &**state;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        while !g.done {
            g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A gate that could not be enqueued holds back what follows it on the host instead: the submissions
/// after this one on its stream wait for it to finish submitting ([`wait_done`]), so it finishes only once
/// the gate is open — or once no one else holds the gate, when no one can open it any more (its drop opens
/// it). Without this, the copies queued behind a failed gate would run before the bytes they read are there.
fn hold_until_open(gate: &Arc<crate::cuda::HostGate>) {
    while !gate.wait_open_for(std::time::Duration::from_millis(20)) {
        if Arc::strong_count(gate) == 1 {
            return;
        }
    }
}

fn finish(state: &State, res: Result<()>) {
    let (m, cv) = &**state;
    let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
    g.done = true;
    g.error = res.err();
    cv.notify_all();
}

/// A per-layer submission running on a native thread (see [`submit_layers_background`]).
pub struct Submission {
    state: State,
    groups: usize,
}

impl Submission {
    fn wait_until(&self, enough: impl Fn(&Progress) -> bool) -> Result<()> {
        let (m, cv) = &*self.state;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        while !enough(&g) && !g.done {
            g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        match &g.error {
            Some(Error::Cuda { call, code, detail }) => Err(Error::Cuda {
                call,
                code: *code,
                detail: detail.clone(),
            }),
            Some(e) => Err(Error::CudaUnavailable(format!(
                "background submission failed: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// Blocks until the events of layer `index` (0-based within the submission) have been recorded; the
    /// submission's error if it failed first.
    pub fn wait_recorded(&self, index: usize) -> Result<()> {
        if index >= self.groups {
            return Err(Error::arg(
                "index",
                format!("must be < {}, got {index}", self.groups),
            ));
        }
        self.wait_until(move |p| p.recorded > index)
    }

    /// Blocks until every copy has been submitted; the submission's error if any.
    pub fn join(&self) -> Result<()> {
        self.wait_until(|p| p.done)
    }

    /// True once every copy has been submitted (or the submission failed).
    pub fn finished(&self) -> bool {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner()).done
    }
}

/// As [`super::submit_layers`] with `per_layer`, but submitted by a native thread. The thread first waits
/// until `previous` (the last background submission on the same stream, if any) has finished submitting, so
/// submissions reach the stream in call order, then makes the stream wait for `after` (an event, 0 = none).
/// Wait on [`Submission::wait_recorded`]`(i)` before making a stream wait on layer i's events. The caller
/// keeps `after`, the events and the device memory alive until [`Submission::finished`] and the last events
/// have completed; the thread itself keeps the host mappings alive until it is done. On an error the thread
/// waits for everything it enqueued before it reports finished.
#[allow(clippy::too_many_arguments)]
pub fn submit_layers_background(
    plans: &[&Plan],
    layer_begin: usize,
    layer_end: usize,
    device: i32,
    stream: usize,
    side_streams: Vec<usize>,
    batch: bool,
    events: &[usize],
    after: usize,
    previous: Option<&Submission>,
) -> Result<Submission> {
    check_sides(stream, &side_streams)?;
    if events.is_empty() {
        return Err(Error::arg(
            "events",
            "a background submission needs events for every layer",
        ));
    }
    let mut groups = build_groups(
        plans,
        layer_begin,
        layer_end,
        true,
        1 + side_streams.len(),
        events,
    )?;
    let regions: Vec<_> = plans.iter().map(|p| p.region().clone()).collect();
    let previous = previous.map(|p| p.state.clone());
    let n = groups.len();
    let state: State = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
    let worker = state.clone();
    std::thread::Builder::new()
        .name("kvtier-submit".into())
        .spawn(move || {
            let _regions = regions; // host memory stays mapped while this thread may submit copies of it
            wait_done(previous.as_ref());
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
            finish(&worker, res.map(|_| ()));
        })
        .map_err(|e| Error::Os {
            what: "spawning the submission thread".into(),
            source: e,
        })?;
    Ok(Submission { state, groups: n })
}

/// Enqueues `gate` (see [`crate::cuda::HostGate`]) on CUDA `stream` of `device` from a native thread, in
/// order after `previous` (the last background submission on that stream): what is submitted on `stream`
/// after this submission finishes does not start on the device before the gate opens. The returned
/// submission has no layers; [`Submission::join`] waits until the gate is enqueued. If it cannot be
/// enqueued, the submission reports the error once the gate is open (or dropped by every other holder), so
/// what follows it on `stream` is still not submitted before then.
pub fn submit_gate_background(
    device: i32,
    stream: usize,
    gate: Arc<crate::cuda::HostGate>,
    previous: Option<&Submission>,
) -> Result<Submission> {
    let previous = previous.map(|p| p.state.clone());
    let state: State = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
    let worker = state.clone();
    std::thread::Builder::new()
        .name("kvtier-gate".into())
        .spawn(move || {
            wait_done(previous.as_ref());
            let res = crate::cuda::make_current(device).and_then(|cur| {
                // The gate's state lives as long as the host function needs it (that function holds a count).
                // SAFETY: the caller passes a live stream of `device` (the binding's contract).
                unsafe { cur.enqueue_gate(stream, &gate) }
            });
            if res.is_err() {
                hold_until_open(&gate);
            }
            finish(&worker, res);
        })
        .map_err(|e| Error::Os {
            what: "spawning the gate's submission thread".into(),
            source: e,
        })?;
    Ok(Submission { state, groups: 0 })
}

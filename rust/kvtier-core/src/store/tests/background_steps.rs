//! Compaction steps on the writer's background thread (docs/STORE.md, "Off the put path"): a put batch
//! hands its step over and never waits for it, and a crash at each point of a step — with batches
//! committing while the step stands there — loses no acknowledged object.

use super::{bytes_at, crash_copy, get1, opts, payload, put_pages, tmp, SERIAL};
use crate::store::log::compact;
use crate::store::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The step point the hook pauses at (once), whether a step stands there, and whether it may go on.
static ARMED: Mutex<Option<&'static str>> = Mutex::new(None);
static PAUSED: AtomicBool = AtomicBool::new(false);
static RELEASE: AtomicBool = AtomicBool::new(false);
/// A paused step goes on by itself after this (so a test that fails cannot hang).
const HOLD: Duration = Duration::from_secs(10);

fn hook(_: &Shared, point: &'static str) {
    {
        let mut armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        if *armed != Some(point) {
            return;
        }
        *armed = None;
    }
    PAUSED.store(true, Ordering::SeqCst);
    let t = Instant::now();
    while !RELEASE.load(Ordering::SeqCst) && t.elapsed() < HOLD {
        std::thread::sleep(Duration::from_millis(1));
    }
    PAUSED.store(false, Ordering::SeqCst);
}

/// Installs the hook while alive; every replaced journal closed in the background.
struct Hooked;

impl Hooked {
    fn new() -> Self {
        compact::CLOSE_IN_BACKGROUND_FROM.store(0, Ordering::Relaxed);
        RELEASE.store(false, Ordering::SeqCst);
        *compact::STEP_HOOK.lock().unwrap() = Some(hook);
        Self
    }

    fn arm(&self, point: &'static str) {
        RELEASE.store(false, Ordering::SeqCst);
        *ARMED.lock().unwrap() = Some(point);
    }

    /// Lets a paused step go on and waits until it has.
    fn release(&self) {
        RELEASE.store(true, Ordering::SeqCst);
        let t = Instant::now();
        while PAUSED.load(Ordering::SeqCst) {
            assert!(t.elapsed() < HOLD, "the step did not go on");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Hooked {
    fn drop(&mut self) {
        RELEASE.store(true, Ordering::SeqCst);
        *ARMED.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *compact::STEP_HOOK.lock().unwrap_or_else(|p| p.into_inner()) = None;
        compact::CLOSE_IN_BACKGROUND_FROM
            .store(compact::CLOSE_IN_BACKGROUND_DEFAULT, Ordering::Relaxed);
    }
}

/// Puts batch `b` (6 fresh keys) and records which payload object each key holds.
fn put_batch(
    w: &PageStore,
    b: usize,
    src: &crate::buffer::HostRegion,
    held: &mut HashMap<String, usize>,
) -> Duration {
    let keys: Vec<(String, usize)> = (0..6)
        .map(|i| (format!("{b:08x}{i:056x}.k"), (b * 6 + i) % 16))
        .collect();
    let t = Instant::now();
    let ok = put_pages(w, &keys, src);
    let took = t.elapsed();
    assert!(ok.iter().all(|&x| x), "batch {b}: a put failed");
    held.extend(keys);
    took
}

/// Waits until the background thread's step is paused (true) or has run without pausing (false).
fn paused_or_idle(w: &PageStore) -> bool {
    let t = Instant::now();
    loop {
        if PAUSED.load(Ordering::SeqCst) {
            return true;
        }
        if !w.step_queued.load(Ordering::SeqCst) && w.log.try_compaction().is_some() {
            return PAUSED.load(Ordering::SeqCst);
        }
        assert!(
            t.elapsed() < HOLD,
            "the background step neither ran nor paused"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A crash now: a copy of the store's files holds exactly the writer's keys, each with its own bytes.
fn check_crash_copy(
    w: &PageStore,
    src: &crate::buffer::HostRegion,
    held: &HashMap<String, usize>,
    what: &str,
) {
    let copy = tmp();
    crash_copy(w, &copy);
    let c = PageStore::open(&copy, "ns", opts(1 << 20)).unwrap();
    let (mut have, mut want) = (c.keys(), w.keys());
    have.sort();
    want.sort();
    assert_eq!(have, want, "{what}");
    let dst = payload(1, 4096, 0);
    for k in &want {
        assert!(get1(&c, k, dst.as_ptr() as usize, 4096), "{what}: {k}");
        let i = held[k];
        assert_eq!(
            bytes_at(&dst, 0, 4096),
            bytes_at(src, i * 4096, 4096),
            "{what}: {k}"
        );
    }
    drop(c);
    std::fs::remove_dir_all(copy).unwrap();
}

/// While a compaction's step stands still on the background thread, put batches go on and return: a
/// batch never waits for a step (joined at the batch's end, a step's walk made batches wait 221–344 ms at
/// load). With the step held for `HOLD` (10 s), a batch that joined it would take that long.
#[test]
fn a_batch_never_waits_for_a_compaction_step() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let h = Hooked::new();
    let root = tmp();
    let src = payload(16, 4096, 71);
    let w = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
    let mut held = HashMap::new();
    h.arm("step");
    let mut b = 0;
    while !paused_or_idle(&w) {
        let took = put_batch(&w, b, &src, &mut held);
        assert!(
            took < HOLD / 4,
            "a batch took {took:?}: it waited for the step"
        );
        b += 1;
        assert!(b < 3000, "no compaction step");
    }
    // the step stands at its start; batches commit meanwhile, each far quicker than the hold
    for _ in 0..20 {
        let took = put_batch(&w, b, &src, &mut held);
        b += 1;
        assert!(
            took < HOLD / 4,
            "a batch took {took:?}: it waited for the step"
        );
        assert!(PAUSED.load(Ordering::SeqCst), "the step went on by itself");
    }
    h.release();
    w.flush_background();
    let before = w.stats.compactions.load(Ordering::Relaxed);
    while w.stats.compactions.load(Ordering::Relaxed) == before {
        put_batch(&w, b, &src, &mut held);
        w.flush_background();
        b += 1;
        assert!(b < 6000, "the compaction never finished");
    }
    held.retain(|k, _| w.exists(&[k.as_str()])[0]);
    check_crash_copy(&w, &src, &held, "after the compaction");
    drop(w);
    std::fs::remove_dir_all(root).unwrap();
}

/// A crash at each point of a background step: at its start, with its records written but not synced,
/// synced, and between the finish's sync and its switch. At each, a copy of the store's files is taken
/// while the step stands there, and again after a batch has committed beside it; each copy holds exactly
/// the writer's objects, each with its own bytes.
#[test]
fn a_crash_at_each_point_of_a_background_step_loses_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let h = Hooked::new();
    let root = tmp();
    let src = payload(16, 4096, 72);
    let w = PageStore::open(&root, "ns", opts(1 << 20)).unwrap();
    let mut held = HashMap::new();
    let mut b = 0;
    let start = w.stats.compactions.load(Ordering::Relaxed);
    for point in ["step", "written", "synced", "finish"] {
        h.arm(point);
        while !paused_or_idle(&w) {
            put_batch(&w, b, &src, &mut held);
            b += 1;
            assert!(b < 6000, "no step reached {point}");
        }
        held.retain(|k, _| w.exists(&[k.as_str()])[0]);
        check_crash_copy(&w, &src, &held, &format!("paused at {point}"));
        put_batch(&w, b, &src, &mut held);
        b += 1;
        held.retain(|k, _| w.exists(&[k.as_str()])[0]);
        check_crash_copy(&w, &src, &held, &format!("a batch beside {point}"));
        h.release();
    }
    w.flush_background();
    assert!(
        w.stats.compactions.load(Ordering::Relaxed) > start,
        "no compaction finished"
    );
    held.retain(|k, _| w.exists(&[k.as_str()])[0]);
    check_crash_copy(&w, &src, &held, "at the end");
    drop(w);
    std::fs::remove_dir_all(root).unwrap();
}

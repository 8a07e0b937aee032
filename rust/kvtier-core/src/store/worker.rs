//! The writer's background thread: work a put or delete call must cause but need not wait for, taken off
//! the call's path (docs/STORE.md, "Off the put path"). Three jobs, none of which any promise of the store
//! depends on:
//!
//! - a compaction's step (or its start, when the journal is due). A put batch hands it over and returns
//!   without waiting for it: joined at the batch's end, the step's walk (CPU) made batches wait 221–344 ms
//!   at load 4–9 on 2 cores. A step writes only `journal.compact` and takes the commit lock only for its
//!   start and its finish's switch, as it did in the batch; whichever thread runs it, the compaction's
//!   lock lets one step run at a time. One step is queued at a time (`Shared::step_queued`); each step
//!   writes in proportion to what the journal grew by since the last one, so a step that runs late
//!   catches up. The job holds the store weakly: one that runs after the store is gone does nothing.
//! - closing the journal a compaction replaced, when it is large (`compact::CLOSE_IN_BACKGROUND_FROM`,
//!   4 MiB). The old file is already renamed over (unlinked), so its last `close` frees its blocks: 27–32
//!   ms for a 100 MB journal on ext4 (mounted with `discard`), measured as most of every compaction's
//!   finish, under the commit lock, in the batch that ran it (benches/RESULTS.md, "Page store, full").
//!   Until the thread closes it, its blocks stay allocated, as they do while a follower still holds it.
//!   Before its close the file is cut a piece at a time (`CLOSE_PIECE`), each cut synced: with the blocks of
//!   a 100 MB journal freed in one transaction, the store's next journal sync waited for it (the first del
//!   append after each compaction, 11–43 ms); a piece's transaction is a fraction of that. Only a journal
//!   whose rename survived (the directory synced) is cut: after a failed directory sync the old journal
//!   could be the one a crash brings back.
//! - rewriting `STATS` (a temporary file renamed over it, every 2 s): advice, never synced; its rename took
//!   up to 336 ms inside a put on a loaded machine. The JSON is taken in the call (a few locks, cheap) and
//!   written here, so the file shows the counters of that moment.
//!
//! The thread is started by the first job and joined when the store is dropped (before `STATS` is
//! written a last time and `LOCK` is released). Jobs run in order. If the thread cannot be started, or the
//! process is a fork of the one that started it (a forked child has no copy of the thread), a job runs in
//! the caller, as it did before there was a thread.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, Weak};
use std::thread::JoinHandle;

use super::stats::{on_worker, phase, set_on_worker};

/// The bytes a replaced journal is cut by at a time, each cut synced, before it is closed.
const CLOSE_PIECE: u64 = 8 << 20;

/// A job for the background thread.
pub(super) enum Job {
    /// Close a file (a handle on the journal a compaction replaced).
    Close(File),
    /// Cut the journal a compaction replaced a piece at a time, each cut synced, then close it (its
    /// rename is durable: it is no journal any more).
    CutAndClose(File, Weak<super::Shared>),
    /// A step of the running compaction, or the start of one if the journal is due.
    Step(Weak<super::Shared>),
    /// Write `STATS` (its path) with this content, a temporary file renamed over it.
    Stats { file: PathBuf, body: String },
    /// Tell the sender when every job before it is done.
    Barrier(Sender<()>),
}

impl Job {
    fn run(self) {
        let was = set_on_worker(true);
        self.run_here();
        set_on_worker(was);
    }

    fn run_here(self) {
        match self {
            Job::Close(f) => drop(f),
            Job::CutAndClose(f, store) => {
                let mut t = std::time::Instant::now();
                cut_and_close(f);
                if let Some(s) = store.upgrade() {
                    s.stats.lap(phase::JOURNAL_CLOSE, &mut t);
                }
            }
            Job::Step(store) => {
                let store = store.upgrade();
                if let Some(s) = store.filter(|s| !s.worker.stopped.load(Ordering::Acquire)) {
                    // (none once the store is being dropped: a compaction left running resumes after a reopen)
                    // cleared first: a batch committed during this step queues the next one
                    s.step_queued.store(false, Ordering::Release);
                    let mut t = std::time::Instant::now();
                    s.compact_step();
                    s.stats.lap(phase::COMPACT, &mut t);
                }
            }
            Job::Stats { file, body } => {
                // advice: a failed write keeps the old file
                let _ = super::space::disk::replace_unsynced(&file, &body);
            }
            Job::Barrier(done) => {
                let _ = done.send(());
            }
        }
    }
}

fn cut_and_close(f: File) {
    let mut len = f.metadata().map_or(0, |m| m.len());
    while len > 0 {
        len = len.saturating_sub(CLOSE_PIECE);
        if f.set_len(len).and_then(|()| f.sync_data()).is_err() {
            break; // the close frees what is left
        }
    }
    drop(f);
}

/// The thread and the channel to it.
#[derive(Default)]
pub(super) struct Worker {
    inner: Mutex<Option<Running>>,
    /// Set by `finish`: jobs run in the caller from then on.
    stopped: std::sync::atomic::AtomicBool,
}

struct Running {
    tx: Sender<Job>,
    thread: JoinHandle<()>,
    pid: u32,
}

impl Worker {
    /// Hands the writing of `STATS` (its path) with `body` to the thread ([`Job::Stats`]).
    pub(super) fn write_stats(&self, file: PathBuf, body: String) {
        self.run(Job::Stats { file, body });
    }

    /// Hands `job` to the thread (started if need be), or runs it here if there can be no thread, if the
    /// store is being dropped (`finish`), or if this is a job of the thread (its jobs then keep their order).
    pub(super) fn run(&self, job: Job) {
        if on_worker() {
            return job.run_here();
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if self.stopped.load(Ordering::Acquire) {
            drop(inner);
            return job.run();
        }
        let pid = std::process::id();
        if inner.as_ref().is_some_and(|r| r.pid != pid) {
            // a forked child: the thread is not in this process; its handle must not be joined here
            std::mem::forget(inner.take());
        }
        if inner.is_none() {
            let (tx, rx) = channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name("kvtier-store-bg".into())
                .spawn(move || rx.into_iter().for_each(Job::run));
            match spawned {
                Ok(thread) => *inner = Some(Running { tx, thread, pid }),
                Err(_) => return job.run(),
            }
        }
        let running = inner.as_ref().expect("started above");
        if let Err(e) = running.tx.send(job) {
            e.0.run(); // the thread is gone (it panicked): run it here
        }
    }

    /// Waits until every job handed over so far is done (tests, and `PageStore::flush_background`).
    pub(super) fn wait(&self) {
        let (tx, rx) = channel();
        self.run(Job::Barrier(tx));
        let _ = rx.recv();
    }

    /// Stops the thread after its last job and waits for it (the store is being dropped).
    pub(super) fn finish(&self) {
        let running = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            self.stopped.store(true, Ordering::Release);
            inner.take()
        };
        if let Some(r) = running {
            if r.pid != std::process::id() {
                std::mem::forget(r);
                return;
            }
            drop(r.tx);
            let _ = r.thread.join();
        }
    }
}

impl super::PageStore {
    /// Waits until the background thread has done every job handed to it so far: the journals replaced
    /// by compactions are closed (their blocks given back) and `STATS` holds the counters of the last
    /// call that wrote it.
    pub fn flush_background(&self) {
        self.worker.wait();
    }
}

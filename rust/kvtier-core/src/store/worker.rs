//! The writer's background thread: work a put or delete call must cause but need not wait for, taken off
//! the call's path (docs/STORE.md, "Off the put path"). Two jobs, neither of which any promise of the store
//! depends on:
//!
//! - closing the journal a compaction replaced, when it is large (`compact::CLOSE_IN_BACKGROUND_FROM`,
//!   4 MiB). The old file is already renamed over (unlinked), so its last `close` frees its blocks: 27–32
//!   ms for a 100 MB journal on ext4 (mounted with `discard`), measured as most of every compaction's
//!   finish, under the commit lock, in the batch that ran it (benches/RESULTS.md, "Page store, full").
//!   Until the thread closes it, its blocks stay allocated, as they do while a follower still holds it.
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
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;
use std::thread::JoinHandle;

/// A job for the background thread.
pub(super) enum Job {
    /// Close a file (the journal a compaction replaced, or a handle on it).
    Close(File),
    /// Write `STATS` in `dir` with this content (`stats_file::write`).
    Stats { dir: PathBuf, body: String },
    /// Tell the sender when every job before it is done.
    Barrier(Sender<()>),
}

impl Job {
    fn run(self) {
        match self {
            Job::Close(f) => drop(f),
            Job::Stats { dir, body } => {
                let _ = super::stats_file::write(&dir, &body); // advice: a failed write keeps the old file
            }
            Job::Barrier(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// The thread and the channel to it.
#[derive(Default)]
pub(super) struct Worker {
    inner: Mutex<Option<Running>>,
}

struct Running {
    tx: Sender<Job>,
    thread: JoinHandle<()>,
    pid: u32,
}

impl Worker {
    /// Hands `job` to the thread (started if need be), or runs it here if there can be no thread.
    pub(super) fn run(&self, job: Job) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
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
        let running = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
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

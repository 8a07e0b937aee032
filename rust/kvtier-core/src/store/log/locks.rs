//! The log's locks and their one order. A store's running compaction, a read-only store's place in its
//! writer's journal, the journal (the commit lock, docs/STORE.md R1) and the index are each behind a mutex,
//! and a thread takes them in this order only:
//!
//! 1. `compaction` (writable stores) or `follow` (read-only stores: a store has one or the other);
//! 2. `journal`;
//! 3. `index`.
//!
//! [`Log`] owns the four and is the only way to them: a thread that holds one may wait for a later one,
//! never for an earlier one (or the same). Debug builds check it: each thread keeps the log locks it holds,
//! each with the [`Log`] it belongs to, and waiting for a lock at or before one it holds of the same `Log`
//! panics, naming both (the check compares the locks of one store only). A `try_` lock never
//! waits, so it may be taken in any order (and then counts as held).

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard, TryLockError};

use super::commit::JournalFile;
use super::compact::Compaction;
use super::follow::Follow;
use crate::store::index::Index;

/// Where a lock stands in the order: a thread waits only for a lock of a later level than all it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// The running compaction (writable stores).
    Compaction = 0,
    /// A read-only store's place in its writer's journal.
    Follow = 1,
    /// The journal: the commit lock.
    Journal = 2,
    /// The index.
    Index = 3,
}

#[cfg(debug_assertions)]
thread_local! {
    /// The log locks this thread holds: the address of their [`Log`] and their level. The order binds the
    /// locks of one store only, so another store's locks held by the same thread are no matter.
    static HELD: std::cell::RefCell<Vec<(usize, Level)>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Level {
    /// Marks the level of the log at `log` held by this thread; `wait`: the lock is about to be waited for,
    /// so no lock of that log at this level or a later one may be held.
    fn enter(self, log: usize, wait: bool) {
        #[cfg(debug_assertions)]
        HELD.with(|h| {
            let mut held = h.borrow_mut();
            if wait {
                let at_or_after: Vec<Level> = held
                    .iter()
                    .filter(|&&(l, level)| l == log && level >= self)
                    .map(|&(_, level)| level)
                    .collect();
                if !at_or_after.is_empty() {
                    drop(held);
                    panic!("store lock order: waiting for {self:?} while holding {at_or_after:?}");
                }
            }
            held.push((log, self));
        });
        #[cfg(not(debug_assertions))]
        let _ = (log, wait);
    }

    fn leave(self, log: usize) {
        #[cfg(debug_assertions)]
        HELD.with(|h| {
            let mut held = h.borrow_mut();
            if let Some(i) = held.iter().rposition(|&e| e == (log, self)) {
                held.remove(i);
            }
        });
        #[cfg(not(debug_assertions))]
        let _ = log;
    }
}

/// One of the log's locks, held; released when dropped.
pub(in crate::store) struct Held<'a, T> {
    guard: MutexGuard<'a, T>,
    level: Level,
    /// The address of the [`Log`] the lock is one of.
    log: usize,
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        self.level.leave(self.log);
    }
}

fn wait<'a, T>(log: &Log, m: &'a Mutex<T>, level: Level) -> Held<'a, T> {
    let log = log as *const Log as usize;
    level.enter(log, true);
    Held {
        guard: m.lock().unwrap_or_else(|p| p.into_inner()),
        level,
        log,
    }
}

/// `None` when another thread holds it (or a thread panicked holding it).
fn try_take<'a, T>(log: &Log, m: &'a Mutex<T>, level: Level) -> Option<Held<'a, T>> {
    match m.try_lock() {
        Ok(guard) => {
            let log = log as *const Log as usize;
            level.enter(log, false);
            Some(Held { guard, level, log })
        }
        Err(TryLockError::WouldBlock | TryLockError::Poisoned(_)) => None,
    }
}

/// The log's state behind its locks, taken in their order (see the module docs).
pub(in crate::store) struct Log {
    /// The running compaction, if any (`log::compact`).
    compaction: Mutex<Option<Compaction>>,
    /// Read-only stores: where they are in the writer's journal (`log::follow`).
    follow: Option<Mutex<Follow>>,
    /// The commit lock (docs/STORE.md, R1).
    journal: Mutex<JournalFile>,
    index: Mutex<Index>,
}

impl Log {
    pub(in crate::store) fn new(
        index: Index,
        journal: JournalFile,
        follow: Option<Follow>,
    ) -> Self {
        Self {
            compaction: Mutex::new(None),
            follow: follow.map(Mutex::new),
            journal: Mutex::new(journal),
            index: Mutex::new(index),
        }
    }

    /// The running compaction (waits for a step in another thread).
    pub(in crate::store) fn compaction(&self) -> Held<'_, Option<Compaction>> {
        wait(self, &self.compaction, Level::Compaction)
    }
    /// The running compaction, unless another thread holds it now.
    pub(in crate::store) fn try_compaction(&self) -> Option<Held<'_, Option<Compaction>>> {
        try_take(self, &self.compaction, Level::Compaction)
    }
    /// Whether this store follows a writer (it was opened read-only).
    pub(in crate::store) fn follows(&self) -> bool {
        self.follow.is_some()
    }
    /// A read-only store's place in its writer's journal; `None` for a writable store.
    pub(in crate::store) fn follow(&self) -> Option<Held<'_, Follow>> {
        Some(wait(self, self.follow.as_ref()?, Level::Follow))
    }
    /// The journal: the commit lock.
    pub(in crate::store) fn journal(&self) -> Held<'_, JournalFile> {
        wait(self, &self.journal, Level::Journal)
    }
    /// The journal, unless another thread holds it now.
    pub(in crate::store) fn try_journal(&self) -> Option<Held<'_, JournalFile>> {
        try_take(self, &self.journal, Level::Journal)
    }
    /// The index.
    pub(in crate::store) fn index(&self) -> Held<'_, Index> {
        wait(self, &self.index, Level::Index)
    }
    /// The index, unless another thread holds it now.
    pub(in crate::store) fn try_index(&self) -> Option<Held<'_, Index>> {
        try_take(self, &self.index, Level::Index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log() -> Log {
        Log::new(
            Index::default(),
            JournalFile::open(std::path::Path::new("/dev/null"), false, 1 << 20).unwrap(),
            None,
        )
    }

    #[test]
    fn locks_in_order_pass_and_the_reverse_panics_in_debug_builds() {
        let log = log();
        {
            let _c = log.compaction();
            let _j = log.journal();
            let _i = log.index();
        }
        {
            let _i = log.try_index().unwrap(); // a try-lock may be taken in any order
            let _j = log.try_journal().unwrap();
        }
        let reversed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _i = log.index();
            let _j = log.journal();
        }));
        assert_eq!(reversed.is_err(), cfg!(debug_assertions));
        // the panic released what it held: the order holds again
        let _j = log.journal();
        let _i = log.index();
    }

    #[test]
    fn two_stores_locks_nest_without_a_false_order_panic() {
        let (a, b) = (log(), log());
        {
            // store A's index held while store B takes its whole order, and the reverse
            let _ai = a.index();
            let _bc = b.compaction();
            let _bj = b.journal();
            let _bi = b.index();
        }
        {
            let _bi = b.index();
            let _aj = a.journal();
            let _ai = a.index();
        }
        {
            // two same-level try-locks of two stores: dropping one leaves the other held
            let ai = a.try_index().unwrap();
            let _bi = b.try_index().unwrap();
            drop(ai);
            let b_again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _bj = b.journal();
            }));
            assert_eq!(b_again.is_err(), cfg!(debug_assertions));
            let _aj = a.journal(); // A's index was released
        }
    }
}

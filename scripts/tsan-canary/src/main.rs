//! The control experiment of `scripts/sanitize.sh tsan`: shows that the ThreadSanitizer build it makes
//! (nightly, `-Zsanitizer=thread`, `-Zbuild-std`) reports a real data race, and reports nothing for
//! accesses that std's own synchronisation orders. Not part of the workspace; never run outside TSan.
//!
//!   tsan-canary race      two threads write one `u64` with no synchronisation: TSan must report it
//!   tsan-canary ordered   plain (non-atomic) data handed between threads by std only (a contended
//!                         `Mutex`, `Condvar`, `thread::scope`'s join, `JoinHandle::join`, an `mpsc`
//!                         channel, `Arc`'s last drop on another thread): TSan must report nothing
//!
//! Each `ordered` case is a pattern kvtier's core relies on and that TSan reported as a race when std
//! was not instrumented (std's futex parking and `Arc`'s drop fence were invisible to it).

use std::collections::VecDeque;
use std::sync::{mpsc, Arc, Condvar, Mutex};

const THREADS: usize = 4;
const ROUNDS: usize = 20_000;

/// Adds one to `*p`, a plain (non-atomic) read and write.
#[inline(never)]
fn bump(p: *mut u64) {
    // The access is deliberately unsynchronised with the other thread's: that data race is what this
    // function exists to show TSan; it runs only in the TSan canary.
    // SAFETY: `p` points to a live `u64` (the caller's `race` keeps it alive until both threads are joined).
    unsafe { *std::hint::black_box(p) += 1 };
}

/// The positive control: an unsynchronised write/write race on one `u64`.
fn race() {
    let mut x = 0u64;
    let p = &mut x as *mut u64 as usize;
    let t = std::thread::spawn(move || bump(p as *mut u64));
    bump(p as *mut u64);
    t.join().expect("canary thread panicked");
    println!("race: x = {x}");
}

/// The negative control: every hand-off below is ordered by std, so TSan must stay silent.
fn ordered() {
    // A contended Mutex guarding plain data (as PageAllocator's free list and the store's index are).
    let q = Mutex::new((VecDeque::new(), 0u64));
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let q = &q;
            s.spawn(move || {
                for i in 0..ROUNDS {
                    let mut g = q.lock().expect("poisoned");
                    g.0.push_back(t * ROUNDS + i);
                    if g.0.len() > 8 {
                        g.0.pop_front();
                    }
                    g.1 += 1;
                }
            });
        }
    });
    let counted = q.lock().expect("poisoned").1;
    assert_eq!(counted, (THREADS * ROUNDS) as u64);

    // Mutex + Condvar (the engine's background submission waits like this).
    let state = Arc::new((Mutex::new((false, Vec::<u64>::new())), Condvar::new()));
    let worker = {
        let state = state.clone();
        std::thread::spawn(move || {
            let (m, cv) = &*state;
            let mut g = m.lock().expect("poisoned");
            g.1 = (0..1000).collect();
            g.0 = true;
            cv.notify_all();
        })
    };
    {
        let (m, cv) = &*state;
        let mut g = m.lock().expect("poisoned");
        while !g.0 {
            g = cv.wait(g).expect("poisoned");
        }
        assert_eq!(g.1.iter().sum::<u64>(), 999 * 1000 / 2);
    }
    worker.join().expect("worker panicked");

    // Scoped workers write disjoint chunks; the spawner reads them after the scope joined them
    // (the store's IO threads and the checksum threads do this).
    let mut out = vec![0u64; THREADS * 1024];
    std::thread::scope(|s| {
        for (t, chunk) in out.chunks_mut(1024).enumerate() {
            s.spawn(move || chunk.iter_mut().for_each(|v| *v = t as u64 + 1));
        }
    });
    assert_eq!(
        out.iter().sum::<u64>(),
        1024 * (1..=THREADS as u64).sum::<u64>()
    );

    // A thread's result read through join.
    let v = std::thread::spawn(|| vec![7u64; 4096])
        .join()
        .expect("thread panicked");
    assert_eq!(v.iter().sum::<u64>(), 7 * 4096);

    // Plain buffers sent through a channel.
    let (tx, rx) = mpsc::channel::<Vec<u64>>();
    let senders: Vec<_> = (0..THREADS as u64)
        .map(|t| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for i in 0..100 {
                    tx.send(vec![t * 100 + i; 64]).expect("receiver gone");
                }
            })
        })
        .collect();
    drop(tx);
    let got: u64 = rx.iter().map(|b| b[0] * b.len() as u64).sum();
    senders
        .into_iter()
        .for_each(|h| h.join().expect("sender panicked"));
    assert_eq!(got, 64 * (0..THREADS as u64 * 100).sum::<u64>());

    // Arc's last owner frees what other threads read (the store's Arc<ClassFile>, HostRegion).
    for _ in 0..200 {
        let shared = Arc::new(vec![1u64; 256]);
        let hs: Vec<_> = (0..THREADS)
            .map(|_| {
                let shared = shared.clone();
                std::thread::spawn(move || shared.iter().sum::<u64>())
            })
            .collect();
        drop(shared);
        for h in hs {
            assert_eq!(h.join().expect("reader panicked"), 256);
        }
    }
    println!("ordered: ok");
}

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("race") => race(),
        Some("ordered") => ordered(),
        _ => {
            eprintln!("usage: tsan-canary race|ordered");
            std::process::exit(2);
        }
    }
}

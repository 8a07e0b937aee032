//! Work taken off the put path (docs/STORE.md, "Off the put path"): a running compaction's step overlapping
//! a batch's IO and commit, the replaced journal closed and `STATS` written by the background thread. A
//! crash between the new steps, and followers reading while they happen, lose no acknowledged object.

use super::{bytes_at, crash_copy, get1, opts, payload, put_pages, tmp, SERIAL};
use crate::store::log::{compact, follow};
use crate::store::*;
use std::sync::atomic::Ordering;

fn key(t: usize, i: usize) -> String {
    format!("{t:02}{i:062x}.k")
}

/// Object `i` of a 16-object payload stands for key `(t, i)`.
fn obj(i: usize) -> usize {
    i % 16
}

/// Closes every replaced journal in the background while alive (the tests hold `SERIAL`).
struct AllInBackground;

impl AllInBackground {
    fn new() -> Self {
        compact::CLOSE_IN_BACKGROUND_FROM.store(0, Ordering::Relaxed);
        Self
    }
}

impl Drop for AllInBackground {
    fn drop(&mut self) {
        compact::CLOSE_IN_BACKGROUND_FROM
            .store(compact::CLOSE_IN_BACKGROUND_DEFAULT, Ordering::Relaxed);
    }
}

/// Writers put batches into a full store whose compaction steps now run beside their batches (in a thread
/// of their own, while the batch writes and commits). After every batch a follower finds each object the
/// batch acknowledged that the writer still holds, with its own bytes. (Crash copies are taken between
/// batches of one writer, below: a copy taken while another thread writes is no crash state, its files
/// being copied at different times.)
#[test]
fn followers_see_every_acknowledged_object_while_batches_overlap_compaction_steps() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let _bg = AllInBackground::new();
    let root = tmp();
    let src = payload(16, 4096, 61);
    let cap = 2 << 20;
    let w = PageStore::open(&root, "ns", opts(cap)).unwrap();
    let r = PageStore::open_read_only(&root, "ns").unwrap();
    let overlapped = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for t in 0..2usize {
            let (w, r, src, overlapped) = (&w, &r, &src, &overlapped);
            sc.spawn(move || {
                let dst = payload(1, 4096, 0);
                for b in 0..200usize {
                    let keys: Vec<(String, usize)> = (0..8)
                        .map(|i| (key(t, b * 8 + i), obj(b * 8 + i)))
                        .collect();
                    overlapped.fetch_add(usize::from(w.compaction_running()), Ordering::Relaxed);
                    let ok = put_pages(w, &keys, src);
                    assert!(ok.iter().all(|&x| x), "thread {t} batch {b}: a put failed");
                    for (k, c) in &keys {
                        if get1(r, k, dst.as_ptr() as usize, 4096) {
                            assert_eq!(
                                bytes_at(&dst, 0, 4096),
                                bytes_at(src, c * 4096, 4096),
                                "{k}"
                            );
                        } else {
                            // only the other thread's eviction since may have taken it (keys are never
                            // put again): then the writer does not hold it either
                            assert!(
                                !w.exists(&[k.as_str()])[0],
                                "{k}: acknowledged, held, missed"
                            );
                        }
                    }
                }
            });
        }
    });
    let compactions = w.stats.compactions.load(Ordering::Relaxed);
    eprintln!("{compactions} compactions, {overlapped:?} batches beside a step");
    assert!(compactions >= 2, "{compactions} compactions");
    assert!(
        overlapped.load(Ordering::Relaxed) >= 5,
        "{overlapped:?} batches beside a step"
    );
    let held = w.keys().len();
    drop(r);
    drop(w);
    let w = PageStore::open(&root, "ns", opts(cap)).unwrap();
    assert_eq!(w.keys().len(), held);
    std::fs::remove_dir_all(root).unwrap();
}

/// Single-threaded, where every step is known: a crash copy after every batch of a full store (so between
/// the steps of each compaction, and right after each finish, whose old journal the background thread may
/// not have closed yet) holds exactly what the writer held, each object with its own bytes.
#[test]
fn a_crash_after_any_batch_with_background_work_pending_loses_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let _bg = AllInBackground::new();
    let root = tmp();
    let src = payload(16, 4096, 62);
    let cap = 1 << 20;
    let w = PageStore::open(&root, "ns", opts(cap)).unwrap();
    let dst = payload(1, 4096, 0);
    let mut finishes = 0;
    for b in 0..200usize {
        let before = w.stats.compactions.load(Ordering::Relaxed);
        let keys: Vec<(String, usize)> = (0..6)
            .map(|i| (key(0, b * 6 + i), obj(b * 6 + i)))
            .collect();
        assert!(put_pages(&w, &keys, &src).iter().all(|&x| x));
        w.flush_background(); // the step it handed over (paused steps: `a_crash_at_each_point_...`)
        finishes += usize::from(w.stats.compactions.load(Ordering::Relaxed) > before);
        let copy = tmp();
        crash_copy(&w, &copy);
        let c = PageStore::open(&copy, "ns", opts(cap)).unwrap();
        let mut have = c.keys();
        let mut want = w.keys();
        have.sort();
        want.sort();
        assert_eq!(have, want, "batch {b}");
        for (k, i) in &keys {
            assert!(get1(&c, k, dst.as_ptr() as usize, 4096), "batch {b}: {k}");
            assert_eq!(bytes_at(&dst, 0, 4096), bytes_at(&src, i * 4096, 4096));
        }
        drop(c);
        std::fs::remove_dir_all(copy).unwrap();
    }
    assert!(finishes >= 2, "{finishes} compactions finished");
    std::fs::remove_dir_all(root).unwrap();
}

/// The journal a compaction replaced is closed by the background thread: once it has run, the store's
/// blocks are within its capacity again (the old journal's blocks are given back), as before the thread.
/// `STATS` is written by that thread while the writer runs, and once more when it is dropped.
#[test]
fn the_background_thread_gives_the_old_journal_back_and_writes_stats() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let _bg = AllInBackground::new();
    let root = tmp();
    let src = payload(16, 4096, 63);
    let cap = 1 << 20;
    let w = PageStore::open(&root, "ns", opts(cap)).unwrap();
    let mut b = 0;
    while w.stats.compactions.load(Ordering::Relaxed) < 2 {
        let keys: Vec<(String, usize)> = (0..6).map(|i| (key(1, b * 6 + i), obj(i))).collect();
        assert!(put_pages(&w, &keys, &src).iter().all(|&x| x));
        b += 1;
        assert!(b < 2000, "no compaction");
    }
    w.flush_background();
    // the stated bound (tests::disk): the capacity plus 64 KiB of fixed files and metadata
    assert!(
        w.disk_blocks() <= cap + (64 << 10),
        "{} blocks",
        w.disk_blocks()
    );
    // a STATS rewrite is due: it is written by the thread, not in the call
    w.stats_file.written_ms.store(0, Ordering::Relaxed);
    let keys: Vec<(String, usize)> = vec![(key(2, 0), 0)];
    assert!(put_pages(&w, &keys, &src)[0]);
    w.flush_background();
    let text = std::fs::read_to_string(w.dir().join(stats::file::STATS_FILE)).unwrap();
    let puts = w.stats.puts.load(Ordering::Relaxed);
    assert!(text.contains(&format!("\"puts\": {puts},")), "{text}");
    let dir = w.dir().to_owned();
    assert!(put_pages(&w, &[(key(2, 1), 1)], &src)[0]);
    drop(w);
    let text = std::fs::read_to_string(dir.join(stats::file::STATS_FILE)).unwrap();
    assert!(text.contains(&format!("\"puts\": {},", puts + 1)), "{text}");
    assert!(
        std::fs::read_dir(&dir).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("STATS.tmp")),
        "a temporary STATS left behind"
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// A compaction's finish syncs the new journal and preallocates its delete reserve outside the commit lock,
/// then takes the lock for what was committed since. Commits in between (a put of a new key, which grows
/// the del reserve the new journal must carry, and a delete) are copied under the lock: the store, a crash
/// copy of it and a follower that read the old journal all hold exactly them.
#[test]
fn commits_between_the_finish_sync_and_the_switch_are_in_the_new_journal() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let _bg = AllInBackground::new();
    let root = tmp();
    let src = payload(16, 4096, 64);
    let w = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let keys: Vec<(String, usize)> = (0..300).map(|i| (key(3, i), obj(i))).collect();
    assert!(put_pages(&w, &keys, &src).iter().all(|&x| x));
    let gone: Vec<&str> = keys[..100].iter().map(|k| k.0.as_str()).collect();
    assert_eq!(w.delete(&gone).unwrap(), 100);
    let r = PageStore::open_read_only(&root, "ns").unwrap();
    assert!(r.exists(&[keys[150].0.as_str()])[0]);
    static SRC: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    SRC.store(src.as_ptr() as usize, Ordering::Relaxed);
    fn hook(s: &Shared) {
        let late = key(4, 0);
        let p = SRC.load(Ordering::Relaxed) + 5 * 4096;
        // SAFETY: the test's payload is alive while the hook is set.
        assert!(unsafe { s.put(&[(late.as_str(), p, 4096)]) }.unwrap()[0]);
        assert_eq!(s.delete(&[key(3, 150).as_str()]).unwrap(), 1);
    }
    *compact::FINISH_HOOK.lock().unwrap() = Some(hook);
    let before = w.stats.compactions.load(Ordering::Relaxed);
    let r1 = w.compact();
    *compact::FINISH_HOOK.lock().unwrap() = None;
    r1.unwrap();
    assert_eq!(w.stats.compactions.load(Ordering::Relaxed), before + 1);
    let late = key(4, 0);
    let mut want: Vec<(String, usize)> = keys[100..]
        .iter()
        .filter(|k| k.0 != key(3, 150))
        .cloned()
        .collect();
    want.push((late.clone(), 5));
    let check = |s: &PageStore, what: &str| {
        let dst = payload(1, 4096, 0);
        assert!(
            !s.exists(&[key(3, 150).as_str()])[0],
            "{what}: a deleted key"
        );
        for (k, i) in &want {
            assert!(get1(s, k, dst.as_ptr() as usize, 4096), "{what}: {k}");
            assert_eq!(
                bytes_at(&dst, 0, 4096),
                bytes_at(&src, i * 4096, 4096),
                "{what}: {k}"
            );
        }
    };
    check(&w, "writer");
    std::thread::sleep(follow::RECHECK + std::time::Duration::from_millis(20));
    check(&r, "follower");
    assert_eq!(r.keys().len(), want.len());
    let copy = tmp();
    crash_copy(&w, &copy);
    let c = PageStore::open(&copy, "ns", opts(1 << 30)).unwrap();
    check(&c, "crash copy");
    assert_eq!(c.keys().len(), want.len());
    drop(c);
    std::fs::remove_dir_all(copy).unwrap();
    std::fs::remove_dir_all(root).unwrap();
}

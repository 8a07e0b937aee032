//! Compaction of a full store: how often it runs, what it keeps when entries change between its steps, a
//! crash or an IO error at any point of it, and followers that look at the journal only when they must.

use super::{bytes_at, crash_copy, get1, opts, page_key, payload, put1, put_pages, tmp, SERIAL};
use crate::fault::{self, Fault};
use crate::store::log::follow;
use crate::store::*;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Puts `keys` (object `i` of `src` for key `i`), all acknowledged.
fn put_all(s: &PageStore, keys: &[(String, usize)], src: &crate::buffer::HostRegion) {
    let ok = put_pages(s, keys, src);
    assert!(ok.iter().all(|&x| x), "a put failed");
}

/// Every key of `want` is stored in `s` with its own bytes (`want`: key -> object index in `src`), and
/// nothing else is.
fn assert_holds(s: &PageStore, want: &HashMap<String, usize>, src: &crate::buffer::HostRegion) {
    let mut have = s.keys();
    have.sort();
    let mut expect: Vec<String> = want.keys().cloned().collect();
    expect.sort();
    assert_eq!(have, expect);
    let dst = payload(1, 4096, 0);
    for (k, c) in want {
        assert!(get1(s, k, dst.as_ptr() as usize, 4096), "{k} unreadable");
        assert_eq!(
            bytes_at(&dst, 0, 4096),
            bytes_at(src, c * 4096, 4096),
            "{k}"
        );
    }
}

/// A full store evicts in every batch. Compaction runs when the journal's dead records are as many bytes
/// as its live ones, so over N batches it runs O(N · batch / live) times — not once per batch, as when a
/// full store compacted whenever the journal was short of room (every batch of a full store was).
#[test]
fn a_full_store_compacts_once_per_live_journal_not_per_batch() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(16, 4096, 3);
    let cap = 4 << 20; // ~900 objects of 4 KiB
    let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
    let (batches, per) = (400usize, 16usize);
    let mut full_batches = 0;
    for b in 0..batches {
        let keys: Vec<(String, usize)> = (0..per).map(|i| (page_key(b * per + i), i)).collect();
        let ev = s.stats.evictions.load(Ordering::Relaxed);
        put_all(&s, &keys, &src);
        full_batches += usize::from(s.stats.evictions.load(Ordering::Relaxed) > ev);
        let (data, journal) = s.occupancy();
        assert!(
            data + journal <= cap,
            "batch {b}: {data} + {journal} > {cap}"
        );
    }
    let live = s.usage().0;
    let compactions = s.stats.compactions.load(Ordering::Relaxed) as usize;
    // each full batch appends `per` puts and about `per` dels; a compaction follows about `live` records of
    // garbage (the live part's size), so: full_batches * 2 * per / live, plus one for rounding
    let bound = full_batches * 2 * per / live + 2;
    assert!(
        full_batches > 300 && live > 700,
        "{full_batches} full batches, {live} live"
    );
    assert!(
        (1..=bound).contains(&compactions),
        "{compactions} compactions in {full_batches} full batches of {per} with {live} live (bound {bound})"
    );
    // what the journal holds is within its budget: at most the trigger plus a quarter, plus a batch
    let jlen = std::fs::metadata(s.dir().join("journal.log"))
        .unwrap()
        .len();
    let per_rec = journal::encoded_len(page_key(0).len()) as u64;
    assert!(
        jlen <= 5 * live as u64 * per_rec / 2 + 4 * per as u64 * per_rec,
        "journal {jlen}"
    );
    // the most recent batch is all there, and survives a reopen
    let last: HashMap<String, usize> = (0..per)
        .map(|i| (page_key((batches - 1) * per + i), i))
        .collect();
    let dst = payload(1, 4096, 0);
    for (k, c) in &last {
        assert!(get1(&s, k, dst.as_ptr() as usize, 4096));
        assert_eq!(bytes_at(&dst, 0, 4096), bytes_at(&src, c * 4096, 4096));
    }
    let before = s.keys().len();
    drop(s);
    let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
    assert_eq!(s.keys().len(), before);
    std::fs::remove_dir_all(root).unwrap();
}

/// Entries touched (moved past the walk), deleted, put again or newly put between the steps of one
/// compaction all come out as they are: the store after it, and after a reopen, holds exactly what it held.
#[test]
fn compaction_steps_keep_what_changes_between_them() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(16, 4096, 9);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let mut want: HashMap<String, usize> = HashMap::new();
    let keys: Vec<(String, usize)> = (0..200).map(|i| (page_key(i), i % 16)).collect();
    put_all(&s, &keys, &src);
    want.extend(keys.iter().cloned());
    let mut c = Some(s.compaction_begin().unwrap());
    let dst = payload(1, 4096, 0);
    let mut round = 0usize;
    while let Some(step) = c.take() {
        // between steps: touch entries the walk has not reached yet (newest first), delete some, put one
        // deleted before again and a new one
        let i = 199 - (round * 7) % 200;
        if want.contains_key(&page_key(i)) {
            assert!(get1(&s, &page_key(i), dst.as_ptr() as usize, 4096));
        }
        if round.is_multiple_of(3) {
            let k = page_key((round * 13) % 200);
            s.delete(&[k.as_str()]).unwrap();
            want.remove(&k);
        }
        if round.is_multiple_of(5) {
            let j = (round * 13 + 26) % 200;
            let again = (page_key(j), j % 16); // keys name content: a key put again has its bytes
            let new = (page_key(1000 + round), round % 16);
            put_all(&s, &[again.clone(), new.clone()], &src);
            want.extend([again, new]);
        }
        round += 1;
        // a small step: a few entries of the walk, or a piece of the tail
        c = s.compaction_work(step, 300).unwrap();
    }
    assert!(round > 20, "the compaction ran in {round} steps");
    assert_eq!(s.stats.compactions.load(Ordering::Relaxed), 1);
    assert_holds(&s, &want, &src);
    drop(s);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert_holds(&s, &want, &src);
    assert_eq!(s.open_report().damaged_spans, 0);
    std::fs::remove_dir_all(root).unwrap();
}

/// A crash at any point of a compaction (between its steps, with `journal.compact` half written; right
/// after its rename) and an IO error in any of its steps lose no acknowledged object: the store reopened
/// from the crash holds exactly what it held, each object with its own bytes.
#[test]
fn a_crash_or_an_error_in_a_compaction_loses_no_acknowledged_object() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(16, 4096, 21);
    let cap = 2 << 20;
    let s = PageStore::open(&root, "ns", opts(cap)).unwrap();
    let (mut crashes, mut mid, mut failed) = (0, 0, 0);
    for b in 0..300usize {
        if b == 45 {
            // the next write of a compaction fails: the compaction is given up, its file removed
            fault::set("compact", 0, 1, Fault::Error(libc::EIO));
        }
        let keys: Vec<(String, usize)> = (0..8)
            .map(|i| (page_key(b * 8 + i), (b + i) % 16))
            .collect();
        put_all(&s, &keys, &src);
        if fault::hits("compact") > 0 {
            failed += 1;
            fault::clear();
            assert!(s.log.compaction().is_none());
        }
        let running = s.log.compaction().is_some();
        if running || b % 10 == 0 {
            mid += usize::from(running);
            crashes += 1;
            let want: HashMap<String, usize> = s
                .keys()
                .into_iter()
                .map(|k| {
                    let i = usize::from_str_radix(&k[..64], 16).unwrap();
                    (k, (i / 8 + i % 8) % 16)
                })
                .collect();
            let copy = tmp();
            crash_copy(&s, &copy);
            let r = PageStore::open(&copy, "ns", opts(cap)).unwrap();
            assert!(!r.dir().join("journal.compact").exists());
            assert_holds(&r, &want, &src);
            drop(r);
            std::fs::remove_dir_all(copy).unwrap();
        }
    }
    assert!(mid > 5, "only {mid} crashes during a compaction");
    assert!(failed > 0, "no compaction step failed");
    assert!(
        s.stats.compactions.load(Ordering::Relaxed) >= 2,
        "{crashes} crashes"
    );
    fault::clear();
    std::fs::remove_dir_all(root).unwrap();
}

/// A follower's lookups that find every key cost no look at the journal (a `stat` each, before); a miss
/// looks at once, so an object the writer acknowledged before the lookup is found; and a delete reaches
/// the follower within `follow::RECHECK`.
#[test]
fn a_follower_looks_at_the_journal_on_a_miss_or_after_the_recheck_interval() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 5);
    let p = src.as_ptr() as usize;
    let w = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(put1(&w, "a", p, 4096));
    let r = PageStore::open_read_only(&root, "ns").unwrap();
    let looks = || r.log.follow().unwrap().looks;
    let start = looks();
    for _ in 0..1000 {
        assert_eq!(r.exists(&["a"]), vec![true]);
    }
    assert!(
        looks() - start <= 1,
        "{} looks for 1000 hits",
        looks() - start
    );
    // acknowledged by the writer, then looked up: found at once
    assert!(put1(&w, "b", p + 4096, 4096));
    assert_eq!(r.exists(&["a", "b"]), vec![true, true]);
    let dst = payload(1, 4096, 0);
    assert!(get1(&r, "b", dst.as_ptr() as usize, 4096));
    assert_eq!(bytes_at(&dst, 0, 4096), bytes_at(&src, 4096, 4096));
    // a delete reaches it once the interval has passed
    w.delete(&["a"]).unwrap();
    std::thread::sleep(follow::RECHECK + std::time::Duration::from_millis(20));
    assert_eq!(r.exists(&["b"]), vec![true]);
    assert_eq!(r.exists(&["a"]), vec![false]);
    std::fs::remove_dir_all(root).unwrap();
}

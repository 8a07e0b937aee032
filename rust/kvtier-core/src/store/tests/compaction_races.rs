//! Compaction in steps, reviewed adversarially: puts, deletes, touches and evictions racing every step of
//! a compaction (with a crash copy after each), faults at the compaction's own IO points, the room a
//! compaction takes beside the capacity. Followers: `tests::follower_races`.

use super::{bytes_at, crash_copy, get1, opts, page_key, payload, put1, tmp, SERIAL};
use crate::store::*;
use std::sync::atomic::Ordering;

/// The payload object key `k` = `page_key(i)` holds: object `i % 16` (keys name content: a key put again
/// has the same bytes).
fn content(k: &str) -> usize {
    usize::from_str_radix(&k[..64], 16).unwrap() % 16
}

/// Every key `s` holds has its own bytes, and `s` holds exactly `want`.
fn check_holds(s: &PageStore, want: &[String], src: &crate::buffer::HostRegion, what: &str) {
    let mut have = s.keys();
    have.sort();
    if have != want {
        let extra: Vec<&String> = have.iter().filter(|k| !want.contains(k)).collect();
        let missing: Vec<&String> = want.iter().filter(|k| !have.contains(k)).collect();
        panic!(
            "{what}: keys: {} extra {extra:?}, {} missing {missing:?}",
            extra.len(),
            missing.len()
        );
    }
    let dst = payload(1, 4096, 0);
    for k in want {
        assert!(get1(s, k, dst.as_ptr() as usize, 4096), "{what}: {k}");
        assert_eq!(
            bytes_at(&dst, 0, 4096),
            bytes_at(src, content(k) * 4096, 4096),
            "{what}: {k}"
        );
    }
}

/// Every kind of change between the steps of compactions of a full store, chosen at random: lookups that
/// move entries the walk has not reached past it (or that it has), deletes, a key deleted and put again at
/// once (the slot it frees is the one it takes again: a new generation in the same slot), a key deleted
/// and another put into its slot, batches that evict. After every step: the writer, a crash copy of its
/// files reopened, and a follower all hold exactly the writer's keys, each with its own bytes; the
/// occupancy the index counts stays within the capacity; what the files hold on disk passes it only while
/// a compaction runs, by at most its new journal (twice the live records and the tail copied, plus 4 KiB).
#[test]
fn compaction_steps_racing_every_change_with_a_crash_after_each() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let src = payload(16, 4096, 51);
    let cap = 2 << 20;
    for seed in 1..=3u64 {
        let root = tmp();
        let w = PageStore::open(&root, "ns", opts(cap)).unwrap();
        let r = PageStore::open_read_only(&root, "ns").unwrap();
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as usize
        };
        let mut fresh = 0usize;
        let put_keys = |w: &PageStore, keys: &[String]| {
            let objs: Vec<(&str, usize, u64)> = keys
                .iter()
                .map(|k| (k.as_str(), src.as_ptr() as usize + content(k) * 4096, 4096))
                .collect();
            // SAFETY: every object lies inside `src`.
            let ok = unsafe { w.put(&objs) }.unwrap();
            assert!(ok.iter().all(|&b| b), "a put failed");
        };
        let dst = payload(1, 4096, 0);
        let (mut steps, mut worst) = (0usize, 0i64);
        let mut reused_slots = 0usize;
        // full: every batch evicts
        while w.stats.evictions.load(Ordering::Relaxed) == 0 {
            let keys: Vec<String> = (0..64).map(|i| page_key(fresh + i)).collect();
            fresh += 64;
            put_keys(&w, &keys);
        }
        // odd seeds: only this test steps the compaction, a record or a few at a time (it is kept out of
        // the store's hands, and the calls start none of their own); even seeds: the calls step it too
        let alone = seed % 2 == 1;
        let mut held = None;
        if alone {
            w.log.journal().compact_at = u64::MAX;
        }
        while steps < 250 {
            if alone {
                if held.is_none() {
                    held = Some(w.compaction_begin().unwrap());
                }
            } else {
                let mut running = w.log.compaction();
                if running.is_none() {
                    // one starts now, whatever the journal's length
                    *running = Some(w.compaction_begin().unwrap());
                }
            }
            let end_before = w.log.index().j_end;
            if alone && held.is_some() {
                let (end, allowance) = {
                    let ix = w.log.index();
                    (ix.j_end, ix.journal_allowance())
                };
                if end > allowance / 2 {
                    // it would fall behind: finished now (a batch short of room would otherwise start
                    // one of its own beside it, which only this test's holding it makes possible)
                    assert!(w
                        .compaction_work(held.take().unwrap(), u64::MAX)
                        .unwrap()
                        .is_none());
                    held = Some(w.compaction_begin().unwrap());
                }
            }
            let mut live = w.keys();
            live.sort();
            let pick = |n: usize| live[n % live.len()].clone();
            match next() % 6 {
                0 | 1 => {
                    let k = pick(next());
                    assert!(get1(&w, &k, dst.as_ptr() as usize, 4096));
                }
                2 => {
                    w.delete(&[pick(next()).as_str()]).unwrap();
                }
                3 => {
                    // deleted and put again: the same slot (free slots are taken last in, first out)
                    let k = pick(next());
                    let before = w.log.index().map[k.as_str()].clone();
                    w.delete(&[k.as_str()]).unwrap();
                    put_keys(&w, std::slice::from_ref(&k));
                    if let Some(e) = w.log.index().map.get(k.as_str()) {
                        reused_slots += usize::from(e.slot == before.slot && e.gen != before.gen);
                    }
                }
                4 => {
                    // deleted, and a new key takes its slot
                    w.delete(&[pick(next()).as_str()]).unwrap();
                    put_keys(&w, &[page_key(fresh)]);
                    fresh += 1;
                }
                _ => {
                    let n = 1 + next() % 24;
                    let keys: Vec<String> = (0..n).map(|i| page_key(fresh + i)).collect();
                    fresh += n;
                    put_keys(&w, &keys);
                }
            }
            // a step of the running compaction (the calls above may have stepped or finished it too)
            // alone, a step keeps pace with the journal's growth (as the store's steps do, at 8x) or a
            // batch short of room would finish a compaction of its own beside this one
            let grown = w.log.index().j_end.saturating_sub(end_before) as usize;
            let budget = if alone {
                2 * grown + 1 + next() % 200
            } else {
                100 + next() % 3000
            };
            if alone {
                let c = held.take().expect("running");
                held = w.compaction_work(c, budget as u64).unwrap();
            } else {
                let c = w.log.compaction().take();
                if let Some(c) = c {
                    let left = w.compaction_work(c, budget as u64).unwrap();
                    *w.log.compaction() = left;
                }
            }
            steps += 1;
            let mut want = w.keys();
            want.sort();
            let (data, journal) = w.occupancy();
            assert!(
                data + journal <= cap,
                "step {steps}: {data} + {journal} > {cap}"
            );
            let compacting = held.is_some() || w.log.compaction().is_some();
            let excess = w.disk_blocks() as i64 - cap as i64 - (64 << 10);
            if compacting {
                let ix = w.log.index();
                let allowed = 2 * ix.del_bytes as i64 + 8192;
                worst = worst.max(excess - allowed);
            } else {
                assert!(
                    excess <= 0,
                    "step {steps}: {excess} bytes past the capacity"
                );
            }
            check_holds(
                &r,
                &want,
                &src,
                &format!("seed {seed} step {steps}: follower"),
            );
            if steps % 5 == 0 {
                let copy = tmp();
                crash_copy(&w, &copy);
                let c = PageStore::open(&copy, "ns", opts(cap)).unwrap();
                assert_eq!(c.open_report().damaged_spans, 0);
                check_holds(&c, &want, &src, &format!("seed {seed} step {steps}: crash"));
                drop(c);
                std::fs::remove_dir_all(copy).unwrap();
            }
        }
        eprintln!(
            "seed {seed}: {steps} steps, {} compactions, {} evictions, {reused_slots} keys put again into \
             their slot, worst disk excess past the new journal's bound: {worst}",
            w.stats.compactions.load(Ordering::Relaxed),
            w.stats.evictions.load(Ordering::Relaxed)
        );
        assert!(w.stats.compactions.load(Ordering::Relaxed) >= 4);
        assert!(held.is_none() || alone);
        assert!(w.stats.evictions.load(Ordering::Relaxed) > 0 && reused_slots > 0);
        let mut want = w.keys();
        want.sort();
        drop(w);
        let w = PageStore::open(&root, "ns", opts(cap)).unwrap();
        check_holds(&w, &want, &src, "reopened");
        std::fs::remove_dir_all(root).unwrap();
    }
}

/// An IO error at each of a compaction's own points — creating its file, any write of its walk or its tail
/// (steps interleaved with puts and deletes), the new journal's delete reserve, and the directory sync
/// after the rename — loses nothing: before the rename the compaction is given up (its file removed, the
/// old journal carries on, puts and deletes go on); after it the journal is poisoned (nothing more is
/// acknowledged). Either way the store, a crash copy and the store reopened hold exactly what was
/// acknowledged and not deleted.
#[test]
fn an_error_at_each_point_of_a_compaction_loses_nothing() {
    use crate::fault::{self, Fault};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let src = payload(16, 4096, 53);
    let p = src.as_ptr() as usize;
    let mut cases: Vec<(&str, u64)> = (0..8).map(|k| ("compact", k)).collect();
    cases.extend([("journal_reserve", 0), ("dir_sync", 0)]);
    for (point, skip) in cases {
        let what = format!("{point} after {skip}");
        let root = tmp();
        let w = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        let keys: Vec<String> = (0..120).map(page_key).collect();
        let objs: Vec<(&str, usize, u64)> = keys
            .iter()
            .map(|k| (k.as_str(), p + content(k) * 4096, 4096))
            .collect();
        // SAFETY: every object lies inside `src`.
        assert!(unsafe { w.put(&objs) }.unwrap().iter().all(|&b| b));
        fault::set(point, skip, 1, Fault::Error(libc::EIO));
        let mut c = w.compaction_begin().ok();
        let begun = c.is_some();
        let mut n = 0usize;
        let mut failed = !begun;
        while let Some(step) = c.take() {
            // between steps: a delete, a put again, a new key
            w.delete(&[page_key(n).as_str()]).unwrap();
            assert!(put1(
                &w,
                &page_key(n),
                p + content(&page_key(n)) * 4096,
                4096
            ));
            assert!(put1(
                &w,
                &page_key(500 + n),
                p + content(&page_key(500 + n)) * 4096,
                4096
            ));
            n += 1;
            match w.compaction_work(step, 1500) {
                Ok(left) => c = left,
                Err(_) => failed = true,
            }
        }
        if failed {
            w.compaction_failed();
        }
        let hit = fault::hits(point) > 0;
        fault::clear();
        assert!(hit, "{what}: the fault was never reached");
        let poisoned = point == "dir_sync";
        assert_eq!(failed, !poisoned, "{what}");
        assert_eq!(w.poisoned(), poisoned, "{what}");
        assert!(!w.dir().join("journal.compact").exists(), "{what}");
        let mut want = w.keys();
        want.sort();
        assert_eq!(want.len(), 120 + n, "{what}");
        check_holds(&w, &want, &src, &what);
        // the store goes on: puts and deletes (or, poisoned, acknowledges nothing more)
        assert_eq!(
            put1(&w, &page_key(900), p + content(&page_key(900)) * 4096, 4096),
            !poisoned,
            "{what}"
        );
        assert_eq!(
            w.delete(&[page_key(119).as_str()]).is_ok(),
            !poisoned,
            "{what}"
        );
        let mut want = w.keys();
        want.sort();
        let copy = tmp();
        crash_copy(&w, &copy);
        let r = PageStore::open(&copy, "ns", opts(1 << 30)).unwrap();
        check_holds(&r, &want, &src, &format!("{what}: crash copy"));
        drop(r);
        std::fs::remove_dir_all(copy).unwrap();
        drop(w);
        let w = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
        check_holds(&w, &want, &src, &format!("{what}: reopened"));
        assert!(
            put1(&w, &page_key(901), p + content(&page_key(901)) * 4096, 4096),
            "{what}"
        );
        std::fs::remove_dir_all(root).unwrap();
    }
}

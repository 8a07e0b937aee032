//! One budget for a store directory: claims, shares, idle namespaces, a lower budget (the format
//! version, removal and the counters on disk: `tests::lifecycle`).

use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::store::lifecycle::{namespaces, remove_namespace, set_budget};
use crate::store::space::budget;
use crate::store::space::budget::{Share, Table};
use crate::store::*;
use std::sync::atomic::AtomicU64;

pub(super) const OBJ: u64 = 64 << 10;
/// Files beside the accounted ones, per namespace: NAMESPACE, LOCK, FORMAT, STATS and the directory (the
/// store's own allowance for one namespace).
pub(super) const NS_OVERHEAD: u64 = 64 << 10;

pub(super) fn with_budget(budget: u64) -> StoreOptions {
    StoreOptions {
        budget_bytes: Some(budget),
        ..opts(budget)
    }
}

pub(super) fn claims(root: &Path) -> u64 {
    budget::read_table(root)
        .unwrap()
        .unwrap()
        .1
        .iter()
        .map(|s| s.1)
        .sum()
}

pub(super) fn held(s: &PageStore) -> u64 {
    let (d, j) = s.occupancy();
    d + j
}

#[test]
fn claims_of_racing_writers_never_pass_the_budget() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner()); // the fault table is process-wide
    let root = tmp();
    let budget = 1000u64;
    Table::open(&root, true)
        .unwrap()
        .unwrap()
        .set_budget(budget);
    let granted = std::sync::Mutex::new(0u64);
    let max_seen = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let (root, granted, max_seen) = (&root, &granted, &max_seen);
            sc.spawn(move || {
                let share = Share::open(root, &format!("ns-{t:016x}"), None).unwrap();
                let mut x = t * 7919 + 1;
                for _ in 0..20_000 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let want = (x >> 33) % 700;
                    if share.claim(want) {
                        let mut g = granted.lock().unwrap();
                        *g += want;
                        max_seen.fetch_max(*g, Ordering::Relaxed);
                        assert!(*g <= budget, "granted claims {} over the budget", *g);
                        drop(g);
                        std::thread::yield_now();
                        *granted.lock().unwrap() -= want;
                        share.settle(0);
                    }
                }
            });
        }
    });
    assert!(max_seen.load(Ordering::Relaxed) > 700, "claims overlapped");
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn namespaces_of_a_root_share_its_budget_and_removal_gives_it_back() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let budget = 8 << 20;
    let src = payload(1, OBJ as usize, 3);
    let p = src.as_ptr() as usize;
    let a = PageStore::open(&root, "model-a", with_budget(budget)).unwrap();
    let mut stored = 0;
    for i in 0..200 {
        stored += usize::from(put1(&a, &format!("a{i}"), p, OBJ));
        assert!(held(&a) <= budget);
    }
    assert_eq!(
        stored, 200,
        "a namespace alone evicts its own pages to stay within the budget"
    );
    assert!(a.stats.evictions.load(Ordering::Relaxed) > 0);
    // a second namespace, opened without a budget of its own, honours the root's: `a` holds all of it
    let b = PageStore::open(&root, "model-b", opts(1 << 30)).unwrap();
    let b_ok = (0..20)
        .filter(|i| put1(&b, &format!("b{i}"), p, OBJ))
        .count();
    // (the claims may pass the budget by `b`'s journal allowance, room its journal may grow into, never
    // blocks: the bound is on what is held)
    assert!(held(&a) + held(&b) <= budget);
    assert!(
        b_ok <= 2,
        "{b_ok} pages stored beyond what `a` left of the budget"
    );
    let disk = a.disk_blocks() + b.disk_blocks();
    assert!(
        disk <= budget + 2 * NS_OVERHEAD,
        "disk {disk} over the budget {budget}"
    );
    // `a` ends and is removed: its bytes and its claim leave the root, and `b` can grow into them
    let a_dir = a.dir().file_name().unwrap().to_string_lossy().into_owned();
    drop(a);
    let freed = remove_namespace(&root, &a_dir, false).unwrap();
    assert!(freed >= budget / 2, "freed {freed}");
    assert!(!root.join(&a_dir).exists());
    let b_ok = (0..60)
        .filter(|i| put1(&b, &format!("b{i}"), p, OBJ))
        .count();
    assert_eq!(b_ok, 60);
    assert!(held(&b) <= budget && claims(&root) <= budget);
    drop(b);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_namespace_over_its_fair_share_makes_room_for_one_waiting() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let budget = 8 << 20;
    let src = payload(1, OBJ as usize, 3);
    let p = src.as_ptr() as usize;
    let a = PageStore::open(&root, "first", with_budget(budget)).unwrap();
    for i in 0..200 {
        assert!(put1(&a, &format!("a{i}"), p, OBJ));
    }
    let b = PageStore::open(&root, "second", with_budget(budget)).unwrap();
    assert!(!put1(&b, "b0", p, OBJ), "`first` holds the whole budget");
    // `second` waits: the next put of `first` evicts it down to half the budget (two live writers)
    assert!(put1(&a, "a-next", p, OBJ));
    assert!(held(&a) <= budget / 2, "{} > {}", held(&a), budget / 2);
    let b_ok = (0..200)
        .filter(|i| put1(&b, &format!("b{i}"), p, OBJ))
        .count();
    assert_eq!(
        b_ok, 200,
        "`second` evicts its own pages once it has its share"
    );
    assert!(held(&b) >= budget / 4, "{}", held(&b));
    assert!(held(&a) + held(&b) <= budget && claims(&root) <= budget);
    drop((a, b));
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn writers_racing_in_one_root_stay_within_the_budget() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let budget = 6 << 20;
    let stores: Vec<PageStore> = (0..3)
        .map(|i| PageStore::open(&root, &format!("rank{i}"), with_budget(budget)).unwrap())
        .collect();
    let src = payload(4, 3 * OBJ as usize, 9);
    let p = src.as_ptr() as usize;
    let worst = AtomicU64::new(0);
    let stored: Vec<AtomicU64> = (0..3).map(|_| AtomicU64::new(0)).collect();
    std::thread::scope(|sc| {
        for (t, s) in stores.iter().enumerate() {
            let (stores, worst, stored) = (&stores, &worst, &stored);
            sc.spawn(move || {
                for b in 0..80 {
                    let keys: Vec<String> = (0..4).map(|i| format!("r{t}-{b}-{i}")).collect();
                    // sizes of one to three objects' worth: several size classes
                    let objs: Vec<(&str, usize, u64)> = keys
                        .iter()
                        .enumerate()
                        .map(|(i, k)| {
                            (
                                k.as_str(),
                                p + i * 3 * OBJ as usize,
                                OBJ * (1 + (b + i) as u64 % 3),
                            )
                        })
                        .collect();
                    // SAFETY: every range lies inside `src`.
                    let ok = unsafe { s.put(&objs) }.unwrap();
                    stored[t]
                        .fetch_add(ok.iter().filter(|&&x| x).count() as u64, Ordering::Relaxed);
                    let disk: u64 = stores.iter().map(|s| s.disk_blocks()).sum();
                    worst.fetch_max(disk, Ordering::Relaxed);
                }
            });
        }
    });
    let worst = worst.load(Ordering::Relaxed);
    eprintln!("worst disk of 3 racing namespaces: {worst} for a budget of {budget}");
    // a compaction may hold its new journal beside the old one (a few KiB here): within the overhead
    assert!(worst <= budget + 3 * NS_OVERHEAD, "{worst} > {budget}");
    let total: u64 = stores.iter().map(held).sum();
    assert!(total <= budget, "occupancy {total} > {budget}");
    for (i, n) in stored.iter().enumerate() {
        assert!(
            n.load(Ordering::Relaxed) > 0,
            "namespace {i} stored nothing"
        );
    }
    drop(stores);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn an_idle_namespace_counts_even_one_written_before_the_table() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, OBJ as usize, 5);
    let p = src.as_ptr() as usize;
    let a_dir = {
        let a = PageStore::open(&root, "old-model", opts(1 << 30)).unwrap();
        for i in 0..40 {
            assert!(put1(&a, &format!("k{i}"), p, OBJ));
        }
        a.dir().to_owned()
    };
    // as a store written before the budget table existed
    std::fs::remove_file(root.join(budget::BUDGET_FILE)).unwrap();
    let a_blocks = budget::dir_blocks(&a_dir);
    let budget = 4 << 20;
    let b = PageStore::open(&root, "new-model", with_budget(budget)).unwrap();
    let b_ok = (0..60)
        .filter(|i| put1(&b, &format!("n{i}"), p, OBJ))
        .count();
    assert!(b_ok > 0);
    assert!(
        held(&b) + a_blocks <= budget,
        "{} + {a_blocks} > {budget}",
        held(&b)
    );
    let a = PageStore::open_read_only(&root, "old-model").unwrap();
    assert_eq!(
        a.keys().len(),
        40,
        "an idle namespace is never evicted by another one"
    );
    let (got, list) = namespaces(&root).unwrap();
    assert_eq!(got, Some(budget));
    assert_eq!(list.len(), 2);
    let old = list
        .iter()
        .find(|e| e.namespace.as_deref() == Some("old-model"))
        .unwrap();
    assert!(!old.live && old.claim.is_some_and(|c| c.0 == a_blocks && c.1 == 0));
    let new = list
        .iter()
        .find(|e| e.namespace.as_deref() == Some("new-model"))
        .unwrap();
    assert!(new.live && new.claim.is_some_and(|c| c.1 == std::process::id()));
    drop(b);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_lower_budget_evicts_at_open_and_at_the_next_put() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, OBJ as usize, 7);
    let dst = payload(1, OBJ as usize, 8);
    let (p, d) = (src.as_ptr() as usize, dst.as_ptr() as usize);
    {
        let a = PageStore::open(&root, "m", with_budget(8 << 20)).unwrap();
        for i in 0..100 {
            assert!(put1(&a, &format!("k{i}"), p, OBJ));
        }
    }
    let a = PageStore::open(&root, "m", with_budget(2 << 20)).unwrap();
    assert!(held(&a) <= 2 << 20);
    let kept: Vec<String> = a.keys();
    assert!(!kept.is_empty() && kept.len() < 32, "{} kept", kept.len());
    for k in &kept {
        assert!(get1(&a, k, d, OBJ), "a kept page reads back");
    }
    // lowered again from outside, while it is open: the next put evicts down to it
    set_budget(&root, Some(1 << 20)).unwrap();
    assert!(put1(&a, "after", p, OBJ));
    assert!(held(&a) <= 1 << 20, "{}", held(&a));
    drop(a);
    std::fs::remove_dir_all(root).unwrap();
}

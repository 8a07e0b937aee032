//! One budget for a store directory, the format version, namespace removal and the counters on disk.

use super::budget::{Share, Table};
use super::format::{format_text, FORMAT_FILE};
use super::lifecycle::{namespaces, remove_namespace, set_budget};
use super::tests::{get1, opts, payload, put1, tmp, SERIAL};
use super::*;
use std::sync::atomic::AtomicU64;

const OBJ: u64 = 64 << 10;
/// Files beside the accounted ones, per namespace: NAMESPACE, LOCK, FORMAT, STATS and the directory (the
/// store's own allowance for one namespace).
const NS_OVERHEAD: u64 = 64 << 10;

fn with_budget(budget: u64) -> StoreOptions {
    StoreOptions {
        budget_bytes: Some(budget),
        ..opts(budget)
    }
}

fn claims(root: &Path) -> u64 {
    budget::read_table(root)
        .unwrap()
        .unwrap()
        .1
        .iter()
        .map(|s| s.1)
        .sum()
}

fn held(s: &PageStore) -> u64 {
    let (d, j) = s.occupancy();
    d + j
}

#[test]
fn claims_of_racing_writers_never_pass_the_budget() {
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

#[test]
fn format_files_are_written_checked_and_a_future_or_foreign_one_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    // a root without FORMAT (a store of the current format written before the file existed): opens
    assert!(
        PageStore::open_read_only(&root, "m").is_err(),
        "nothing there yet"
    );
    {
        let s = PageStore::open(&root, "m", opts(1 << 30)).unwrap();
        let text = format_text(1);
        assert_eq!(
            std::fs::read_to_string(root.join(FORMAT_FILE)).unwrap(),
            text
        );
        assert_eq!(
            std::fs::read_to_string(s.dir().join(FORMAT_FILE)).unwrap(),
            text
        );
    }
    std::fs::remove_file(root.join(FORMAT_FILE)).unwrap();
    let ns_dir = root.join(namespace_dir("m"));
    std::fs::remove_file(ns_dir.join(FORMAT_FILE)).unwrap();
    drop(PageStore::open_read_only(&root, "m").unwrap());
    assert!(
        !root.join(FORMAT_FILE).exists(),
        "a read-only open writes nothing"
    );
    drop(PageStore::open(&root, "m", opts(1 << 30)).unwrap());
    assert!(root.join(FORMAT_FILE).exists() && ns_dir.join(FORMAT_FILE).exists());
    // a future format, at the root or in one namespace: refused, naming both versions and what to do
    for at in [root.clone(), ns_dir.clone()] {
        std::fs::write(at.join(FORMAT_FILE), "kvtier page store format 2\n").unwrap();
        for e in [
            PageStore::open(&root, "m", opts(1 << 30)).err().unwrap(),
            PageStore::open_read_only(&root, "m").err().unwrap(),
        ] {
            let msg = e.to_string();
            assert!(
                msg.contains("format 2")
                    && msg.contains("reads format 1")
                    && msg.contains("rm -rf"),
                "{msg}"
            );
        }
        std::fs::write(at.join(FORMAT_FILE), format_text(1)).unwrap();
    }
    // a new namespace is not created in a root of a future format
    std::fs::write(root.join(FORMAT_FILE), "kvtier page store format 3\n").unwrap();
    assert!(PageStore::open(&root, "other", opts(1 << 30)).is_err());
    assert!(!root.join(namespace_dir("other")).exists());
    // a damaged or foreign file
    for junk in [
        &b"kvtier page store format x\n"[..],
        b"",
        b"\x00\x01garbage",
    ] {
        std::fs::write(root.join(FORMAT_FILE), junk).unwrap();
        let msg = PageStore::open(&root, "m", opts(1 << 30))
            .err()
            .unwrap()
            .to_string();
        assert!(msg.contains("not a kvtier format file"), "{msg}");
    }
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_damaged_budget_table_is_refused_with_what_to_do() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    drop(PageStore::open(&root, "m", opts(1 << 30)).unwrap());
    std::fs::write(root.join(budget::BUDGET_FILE), b"not a table").unwrap();
    let msg = PageStore::open(&root, "m", opts(1 << 30))
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("not a kvtier budget table") && msg.contains("remove it"),
        "{msg}"
    );
    std::fs::remove_file(root.join(budget::BUDGET_FILE)).unwrap();
    let s = PageStore::open(&root, "m", opts(1 << 30)).unwrap();
    assert!(
        claims(&root) >= held(&s),
        "rebuilt from the namespaces on disk"
    );
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn removal_is_refused_while_a_writer_holds_the_lock_unless_forced() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, OBJ as usize, 2);
    let p = src.as_ptr() as usize;
    let s = PageStore::open(&root, "live", with_budget(8 << 20)).unwrap();
    assert!(put1(&s, "k", p, OBJ));
    let name = namespace_dir("live");
    let e = remove_namespace(&root, &name, false).err().unwrap();
    assert!(e.to_string().contains("in use by a running process"), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    assert!(
        put1(&s, "k2", p, OBJ),
        "the refused removal changed nothing"
    );
    for bad in ["../x", "ns-123", "ns-0123456789abcdeg", "NAMESPACE", ""] {
        let e = remove_namespace(&root, bad, false).err().unwrap();
        assert!(
            e.to_string().contains("invalid argument `namespace`"),
            "{e}"
        );
    }
    // forced: the directory goes; the live writer keeps its claim (its files stay open) until it ends
    // under a retired name: a writer opening the namespace again takes a new slot, the old one still counts
    remove_namespace(&root, &name, true).unwrap();
    assert!(!root.join(&name).exists());
    let retired = |root: &Path| {
        let slots = budget::read_table(root).unwrap().unwrap().1;
        slots
            .into_iter()
            .find(|s| s.0.starts_with('~') && budget::retired_base(&s.0) == name)
    };
    assert!(retired(&root).is_some_and(|r| r.1 >= held(&s) && r.2 == std::process::id()));
    let again = PageStore::open(&root, "live", opts(1 << 30)).unwrap();
    assert!(put1(&again, "k", p, OBJ), "a new, empty namespace");
    assert!(
        put1(&s, "k3", p, OBJ),
        "the old writer goes on, into its removed files"
    );
    assert!(retired(&root).is_some_and(|r| r.1 >= held(&s)));
    drop(s);
    drop(PageStore::open(&root, "next", opts(1 << 30)).unwrap()); // reconciles: the retired slot is freed
    assert!(retired(&root).is_none());
    let (_, list) = namespaces(&root).unwrap();
    assert_eq!(list.len(), 2);
    assert!(list.iter().any(|e| e.dir == name && e.live));
    drop(again);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_writer_opening_while_its_namespace_is_removed_gets_a_whole_store() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, 8192, 4);
    let dst = payload(1, 8192, 5);
    let (p, d) = (src.as_ptr() as usize, dst.as_ptr() as usize);
    let name = namespace_dir("raced");
    let stop = AtomicBool::new(false);
    let (mut opened, mut removed) = (0, 0);
    std::thread::scope(|sc| {
        let remover = sc.spawn(|| {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += usize::from(remove_namespace(&root, &name, false).is_ok());
            }
            n
        });
        for i in 0..200 {
            let Ok(s) = PageStore::open(&root, "raced", opts(1 << 30)) else {
                continue; // refused: the removal held the LOCK
            };
            opened += 1;
            let key = format!("k{i}");
            // an acknowledged page of an open store reads back while it is open (removal waits for it)
            if put1(&s, &key, p, 8192) {
                assert!(get1(&s, &key, d, 8192));
                assert!(
                    s.dir().join("journal.log").exists(),
                    "the store's directory is its own"
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        removed = remover.join().unwrap();
    });
    eprintln!("opened {opened}, removed {removed}");
    assert!(opened > 0 && removed > 0);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn the_writer_leaves_its_counters_on_disk() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, 8192, 6);
    let p = src.as_ptr() as usize;
    let dir = {
        let s = PageStore::open(&root, "m", with_budget(1 << 30)).unwrap();
        assert!(put1(&s, "a", p, 8192));
        assert!(get1(&s, "a", p, 8192));
        assert!(!get1(&s, "nope", p, 8192));
        s.dir().to_owned()
    };
    let text = std::fs::read_to_string(dir.join(stats_file::STATS_FILE)).unwrap();
    for want in [
        "\"hits\": 1,",
        "\"misses\": 1,",
        "\"puts\": 1,",
        "\"bytes_written\": 8192,",
        "\"capacity_bytes\": 1073741824,",
        "\"budget_bytes\": 1073741824,",
        "\"objects\": 1,",
    ] {
        assert!(text.contains(want), "{want} not in {text}");
    }
    assert!(text.contains(&format!("\"pid\": {},", std::process::id())));
    std::fs::remove_dir_all(root).unwrap();
}

//! A maintenance open (an erase, a repair) keeps the counters and the capacity the namespace's engine left
//! in `STATS`, adds only what it changed itself, and records when it ran.

use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::seal::{tenant_keys, tenant_tag};
use crate::store::*;

/// `STATS` of `dir` as its numbers by name.
fn saved(dir: &Path) -> HashMap<String, u64> {
    stats::file::load(dir).into_iter().collect()
}

/// An engine's run: three objects (two of alice's, one of bob's) put with a capacity of 1 GiB, read back
/// (3 hits) and one miss; returns the namespace directory.
fn engine_run(root: &Path) -> PathBuf {
    let len = 8192usize;
    let src = payload(3, len, 7);
    let p = src.as_ptr() as usize;
    let alice = tenant_keys("alice", &["a".repeat(64), "b".repeat(64)]).unwrap();
    let bob = tenant_keys("bob", &["a".repeat(64)]).unwrap();
    let s = PageStore::open(root, "ns", opts(1 << 30)).unwrap();
    for (i, k) in alice.iter().chain(&bob).enumerate() {
        assert!(put1(&s, k, p + i * len, len as u64));
        assert!(get1(&s, k, p + i * len, len as u64));
    }
    assert!(!get1(&s, &"c".repeat(64), p, len as u64));
    let dir = s.dir().to_owned();
    drop(s);
    dir
}

#[test]
fn a_maintenance_open_keeps_the_engines_counters_and_capacity() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let dir = engine_run(&root);
    let engine = saved(&dir);
    assert_eq!(engine["hits"], 3);
    assert_eq!(engine["misses"], 1);
    assert_eq!(engine["puts"], 3);
    assert_eq!(engine["capacity_bytes"], 1 << 30);
    assert!(!engine.contains_key("maintained_unix_ms"));
    // an erase of a tenant with nothing stored, and a repair of an undamaged store: nothing changes
    let s = PageStore::open_maintenance(&root, "ns", opts(1 << 62)).unwrap();
    assert_eq!(s.erase_tenant(&tenant_tag("nobody").unwrap()).unwrap(), 0);
    let r = s.verify(true).unwrap();
    assert_eq!((r.checked, r.corrupt.len()), (3, 0));
    drop(s);
    let after = saved(&dir);
    for k in [
        "pid",
        "opened_unix_ms",
        "capacity_bytes",
        "hits",
        "misses",
        "puts",
        "bytes_written",
        "bytes_read",
        "evictions",
        "objects",
        "bytes_used",
        "write_failures",
        "corrupt_reads",
    ] {
        assert_eq!(after.get(k), engine.get(k), "{k}: {after:?}");
    }
    assert!(after["maintained_unix_ms"] >= engine["written_unix_ms"]);
    // an erase that removes objects: they leave the store, the engine's traffic stays
    let s = PageStore::open_maintenance(&root, "ns", opts(1 << 62)).unwrap();
    assert_eq!(s.erase_tenant(&tenant_tag("alice").unwrap()).unwrap(), 2);
    drop(s);
    let erased = saved(&dir);
    assert_eq!(erased["objects"], 1);
    assert_eq!(erased["bytes_used"], engine["bytes_used"] / 3);
    assert!(erased["compactions"] > after["compactions"]);
    for k in ["hits", "misses", "puts", "capacity_bytes", "pid"] {
        assert_eq!(erased[k], engine[k], "{k}");
    }
    // the engine's next open counts from its open, as always
    drop(PageStore::open(&root, "ns", opts(1 << 29)).unwrap());
    let next = saved(&dir);
    assert_eq!((next["hits"], next["capacity_bytes"]), (0, 1 << 29));
    assert_eq!(next["pid"], u64::from(std::process::id()));
    assert!(!next.contains_key("maintained_unix_ms"));
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_maintenance_open_without_readable_counters_claims_no_capacity() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let dir = engine_run(&root);
    let stats = dir.join(stats::file::STATS_FILE);
    let elsewhere = root.join("elsewhere");
    std::fs::copy(&stats, &elsewhere).unwrap();
    // missing, damaged, another format, or a link (never followed): nothing to keep
    let plant: [&dyn Fn(); 4] = [
        &|| (),
        &|| std::fs::write(&stats, "{\"format\": 1, \"hits\": 3, \"capacity_bytes\": ").unwrap(),
        &|| std::fs::write(&stats, "{\"format\": 2, \"hits\": 3}").unwrap(),
        &|| std::os::unix::fs::symlink(&elsewhere, &stats).unwrap(),
    ];
    for (i, plant) in plant.iter().enumerate() {
        let _ = std::fs::remove_file(&stats);
        plant();
        assert!(stats::file::load(&dir).is_empty(), "case {i}");
        drop(PageStore::open_maintenance(&root, "ns", opts(1 << 62)).unwrap());
        let after = saved(&dir);
        assert!(!after.contains_key("capacity_bytes"), "case {i}: {after:?}");
        assert_eq!(after["hits"], 0, "case {i}");
        assert_eq!(after["objects"], 3, "case {i}");
        assert_eq!(after["pid"], u64::from(std::process::id()), "case {i}");
        assert!(after.contains_key("maintained_unix_ms"), "case {i}");
    }
    std::fs::remove_dir_all(root).unwrap();
}

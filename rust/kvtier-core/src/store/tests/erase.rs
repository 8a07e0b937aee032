//! What a store keeps of a tenant and its names: a sealed store's files hold no engine key and no tenant
//! tag; erasing a tenant overwrites its bytes, compacts its names out of the journal and refuses its puts.

use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::seal::{tenant_keys, tenant_tag, Keyring};
use crate::store::*;

/// Whether any file under `dir` contains `needle`.
fn found_in(dir: &Path, needle: &[u8]) -> bool {
    std::fs::read_dir(dir).unwrap().flatten().any(|e| {
        let p = e.path();
        if p.is_dir() {
            return found_in(&p, needle);
        }
        let b = std::fs::read(&p).unwrap_or_default();
        b.windows(needle.len()).any(|w| w == needle)
    })
}

/// Bytes of one test object.
const LEN: usize = 8192;

/// `LEN` bytes of recognisable plaintext: `word` repeated, so a leftover is found by searching the files.
fn plaintext(word: &[u8; 18]) -> Vec<u8> {
    word.repeat(LEN / 18 + 1)
}

/// Alice's keys for two engine keys (`a…`, `b…`) and Bob's for one (`bob` repeated: the same engine key as
/// one of Alice's, or another).
fn tenants(bob: &str) -> (Vec<String>, Vec<String>) {
    let alice = tenant_keys("alice", &["a".repeat(64), "b".repeat(64)]).unwrap();
    (alice, tenant_keys("bob", &[bob.repeat(64)]).unwrap())
}

#[test]
fn a_sealed_stores_files_name_no_engine_key_and_no_tenant() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    Keyring::init(&root.join("keys")).unwrap();
    let kr = Arc::new(Keyring::open(&root.join("keys")).unwrap());
    let engine = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let salted = tenant_keys("user-48213", &[engine.to_owned()]).unwrap();
    let tag = tenant_tag("user-48213").unwrap();
    let len = 8192usize;
    let src = payload(2, len, 4);
    let o = StoreOptions {
        keyring: Some(kr.clone()),
        ..opts(1 << 30)
    };
    let s = PageStore::open(&root, "ns", o.clone()).unwrap();
    assert!(put1(&s, engine, src.as_ptr() as usize, len as u64));
    assert!(put1(
        &s,
        &salted[0],
        src.as_ptr() as usize + len,
        len as u64
    ));
    drop(s);
    let store_dir = root.join(namespace_dir("ns"));
    for needle in [engine, &salted[0], &salted[0][34..], &tag] {
        assert!(!found_in(&store_dir, needle.as_bytes()), "{needle} on disk");
        assert!(
            !found_in(&root.join("keys"), needle.as_bytes()),
            "{needle} in the keyring"
        );
    }
    // and yet the store serves them by their keys, after a reopen too
    let s = PageStore::open(&root, "ns", o).unwrap();
    let d = payload(1, len, 0);
    assert!(get1(&s, engine, d.as_ptr() as usize, len as u64));
    assert!(get1(&s, &salted[0], d.as_ptr() as usize, len as u64));
    assert_eq!(s.keys().len(), 2);
    assert!(!s
        .keys()
        .iter()
        .any(|k| k.contains(engine) || k.contains(&tag)));
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn erasing_a_tenant_in_clear_leaves_neither_its_bytes_nor_its_names_and_refuses_its_puts() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let len = LEN;
    let (marker, bob_bytes) = (
        plaintext(b"ALICE-KV-PLAINTEXT"),
        plaintext(b"BOB-KV-PLAINTEXT!!"),
    );
    let (alice, bob) = tenants("a");
    let tag = tenant_tag("alice").unwrap();
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    for k in &alice {
        assert!(put1(&s, k, marker.as_ptr() as usize, len as u64));
    }
    assert!(put1(&s, &bob[0], bob_bytes.as_ptr() as usize, len as u64));
    let dir = root.join(namespace_dir("ns"));
    assert!(found_in(&dir, &marker[..64]) && found_in(&dir, alice[0].as_bytes()));
    assert_eq!(s.erase_tenant(&tag).unwrap(), 2);
    // nothing of alice's in the data files or the journal, while the store is still open
    assert!(!found_in(&dir, &marker[..64]), "alice's bytes remain");
    for k in &alice {
        assert!(
            !found_in(&dir, k.as_bytes()),
            "alice's name remains in the journal"
        );
    }
    // bob untouched; alice's puts refused (a writer still holding her pages) until allowed
    let d = payload(1, len, 0);
    assert!(get1(&s, &bob[0], d.as_ptr() as usize, len as u64));
    assert!(!put1(&s, &alice[0], marker.as_ptr() as usize, len as u64));
    assert!(!s.exists(&[alice[0].as_str()])[0]);
    assert!(!found_in(&dir, &marker[..64]));
    assert!(s.allow_tenant(&tag).unwrap());
    assert!(put1(&s, &alice[0], marker.as_ptr() as usize, len as u64));
    assert!(s.erase_tenant("0123").is_err());
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn erasing_a_tenant_of_a_sealed_store_finds_it_by_its_keyed_tag() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    Keyring::init(&root.join("keys")).unwrap();
    let kr = Arc::new(Keyring::open(&root.join("keys")).unwrap());
    let o = StoreOptions {
        keyring: Some(kr.clone()),
        ..opts(1 << 30)
    };
    let len = 8192usize;
    let src = payload(1, len, 6);
    let (alice, bob) = tenants("a");
    let s = PageStore::open(&root, "ns", o).unwrap();
    for k in alice.iter().chain(&bob) {
        assert!(put1(&s, k, src.as_ptr() as usize, len as u64));
    }
    assert_eq!(s.erase_tenant(&tenant_tag("alice").unwrap()).unwrap(), 2);
    assert_eq!(s.keys().len(), 1);
    let d = payload(1, len, 0);
    assert!(get1(&s, &bob[0], d.as_ptr() as usize, len as u64));
    assert!(!get1(&s, &alice[1], d.as_ptr() as usize, len as u64));
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_put_in_flight_when_its_tenant_is_erased_is_erased_with_it() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let len = LEN;
    let marker = plaintext(b"ALICE-KV-PLAINTEXT");
    let alice = tenant_keys("alice", &["a".repeat(64)]).unwrap();
    let tag = tenant_tag("alice").unwrap();
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let dir = root.join(namespace_dir("ns"));
    // the put passes its refusal check, then stalls in its data write while the erasure runs
    crate::fault::set(
        "data_write",
        0,
        1,
        crate::fault::Fault::Delay(std::time::Duration::from_millis(300)),
    );
    let stored = std::thread::scope(|sc| {
        let h = sc.spawn(|| put1(&s, &alice[0], marker.as_ptr() as usize, len as u64));
        let t0 = std::time::Instant::now();
        while crate::fault::hits("data_write") == 0 && t0.elapsed().as_secs() < 30 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(crate::fault::hits("data_write"), 1, "the put never wrote");
        s.erase_tenant(&tag).unwrap();
        h.join().unwrap()
    });
    crate::fault::clear();
    // whatever the put reported, after the erasure returned nothing of alice's is stored or on disk
    let _ = stored;
    assert!(
        !s.exists(&[alice[0].as_str()])[0],
        "the in-flight put survived the erasure"
    );
    assert!(!found_in(&dir, &marker[..64]));
    assert!(!found_in(&dir, alice[0].as_bytes()));
    drop(s);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(!s.exists(&[alice[0].as_str()])[0]);
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn erasing_a_tenant_clears_the_slots_and_records_of_its_objects_deleted_before() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let len = LEN;
    let (marker, bob_bytes) = (
        plaintext(b"ALICE-KV-PLAINTEXT"),
        plaintext(b"BOB-KV-PLAINTEXT!!"),
    );
    let (alice, bob) = tenants("c");
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let dir = root.join(namespace_dir("ns"));
    for k in &alice {
        assert!(put1(&s, k, marker.as_ptr() as usize, len as u64));
    }
    let names: Vec<&str> = alice.iter().map(String::as_str).collect();
    assert_eq!(s.delete(&names).unwrap(), 2);
    assert!(put1(&s, &bob[0], bob_bytes.as_ptr() as usize, len as u64));
    // deleted, yet still in a free slot and in the journal's records
    assert!(found_in(&dir, &marker[..64]) && found_in(&dir, alice[0].as_bytes()));
    // nothing of hers is live: the erasure still clears what her deleted objects left
    assert_eq!(s.erase_tenant(&tenant_tag("alice").unwrap()).unwrap(), 0);
    assert!(
        !found_in(&dir, &marker[..64]),
        "a freed slot keeps alice's KV"
    );
    for k in &alice {
        assert!(!found_in(&dir, k.as_bytes()), "the journal keeps {k}");
    }
    let d = payload(1, len, 0);
    assert!(get1(&s, &bob[0], d.as_ptr() as usize, len as u64));
    // the scrubbed slots are reused
    assert!(put1(
        &s,
        &bob[0][..bob[0].len() - 1],
        bob_bytes.as_ptr() as usize,
        len as u64
    ));
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn erasing_a_tenant_while_a_compaction_runs_leaves_no_name_in_the_journal() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let len = 8192usize;
    let src = payload(1, len, 3);
    let (alice, bob) = tenants("c");
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let dir = root.join(namespace_dir("ns"));
    for k in alice.iter().chain(&bob) {
        assert!(put1(&s, k, src.as_ptr() as usize, len as u64));
    }
    // a compaction begun now walks alice's records into its new journal, and is left running with a
    // tail to copy
    let mut c = s.inner.compaction_begin().unwrap();
    assert!(put1(&s, &bob[0][..63], src.as_ptr() as usize, len as u64));
    while !c.walked() {
        c = s
            .inner
            .compaction_work(c, 1)
            .unwrap()
            .expect("still running");
    }
    // and a step of it is under way (another thread holds it) while the erasure deletes her records
    let held = std::sync::Barrier::new(2);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut running = s.inner.log.compaction();
            *running = Some(c);
            held.wait();
            std::thread::sleep(std::time::Duration::from_millis(300));
        });
        held.wait();
        assert_eq!(s.erase_tenant(&tenant_tag("alice").unwrap()).unwrap(), 2);
    });
    for k in &alice {
        assert!(!found_in(&dir, k.as_bytes()), "the journal keeps {k}");
    }
    drop(s);
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let mut keys = s.keys();
    keys.sort();
    assert_eq!(keys, vec![bob[0][..63].to_owned(), bob[0].clone()]);
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

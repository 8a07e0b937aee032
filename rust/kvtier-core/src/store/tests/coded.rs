//! Coded (compressed) objects: stored in fewer blocks, read back exact through every path (one and two
//! passes, replay, compaction, a follower, a store without a codec, sealed), incompressible objects stored
//! as given, and damage of every kind a counted miss: the stored bytes (header, table, planes) and a
//! decode that fails after the stored checksum passed.

use super::{opts, tmp, SERIAL};
use crate::codec::Elem;
use crate::store::journal::{parse_resync, Record};
use crate::store::*;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

/// `n` objects of `len` bytes of KV-shaped bf16 (not real KV: per-channel log-normal scales), aligned.
fn kv_objects(n: usize, len: usize, seed: u64) -> crate::buffer::HostRegion {
    let stride = len.div_ceil(4096) * 4096;
    let r = crate::buffer::HostRegion::new(n * stride + 4096, &Default::default()).unwrap();
    for i in 0..n {
        let v = crate::codec::tests::kv_like_bf16(len / 2 + 1, 64, seed * 1000 + i as u64);
        // SAFETY: object i lies inside the region; nothing else uses it.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), r.as_ptr().add(i * stride), len) };
    }
    r
}

fn coded_opts() -> StoreOptions {
    StoreOptions {
        codec: Some(Elem::Bits16),
        ..opts(1 << 30)
    }
}

fn obj(r: &crate::buffer::HostRegion, i: usize, len: usize) -> &[u8] {
    let stride = len.div_ceil(4096) * 4096;
    // SAFETY: object i lies inside the live region and no IO is in flight.
    unsafe { std::slice::from_raw_parts(r.as_ptr().add(i * stride), len) }
}

fn objs<'a>(
    keys: &'a [String],
    r: &crate::buffer::HostRegion,
    len: usize,
) -> Vec<(&'a str, usize, u64)> {
    let stride = len.div_ceil(4096) * 4096;
    keys.iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), r.as_ptr() as usize + i * stride, len as u64))
        .collect()
}

fn zero(r: &crate::buffer::HostRegion) {
    // SAFETY: the region owns its bytes; no IO is in flight.
    unsafe { std::ptr::write_bytes(r.as_ptr(), 0, r.len()) };
}

fn put_all(
    s: &PageStore,
    keys: &[String],
    src: &crate::buffer::HostRegion,
    len: usize,
) -> Vec<bool> {
    // SAFETY: the sources lie in `src`, live and unchanged during the call.
    unsafe { s.put(&objs(keys, src, len)) }.unwrap()
}

fn get_all(
    s: &PageStore,
    keys: &[String],
    dst: &crate::buffer::HostRegion,
    len: usize,
) -> Vec<bool> {
    zero(dst);
    // SAFETY: the destinations lie in `dst`, live and only ours during the call.
    unsafe { s.get(&objs(keys, dst, len)) }.unwrap()
}

fn same(
    a: &crate::buffer::HostRegion,
    b: &crate::buffer::HostRegion,
    n: usize,
    len: usize,
) -> bool {
    (0..n).all(|i| obj(a, i, len) == obj(b, i, len))
}

/// Lengths: under a chunk, a page of Llama-8B's K (4 MiB, 16 chunks, 4 pieces), an odd one.
const LENS: [usize; 3] = [96 << 10, 4 << 20, (1 << 20) + 4098];

#[test]
fn coded_objects_take_fewer_blocks_and_read_back_exact_everywhere() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for len in LENS {
        let root = tmp();
        let n = 5;
        let keys: Vec<String> = (0..n).map(|i| format!("page-{i}.k")).collect();
        let src = kv_objects(n, len, len as u64);
        let dst = kv_objects(n, len, 77);
        {
            let s = PageStore::open(&root, "ns", coded_opts()).unwrap();
            let ok = put_all(&s, &keys, &src, len);
            assert_eq!(ok, vec![true; n]);
            let st = &s.stats;
            let (raw, coded) = (
                st.raw_bytes_written.load(Ordering::Relaxed),
                st.bytes_written.load(Ordering::Relaxed),
            );
            assert_eq!(raw, (n * len) as u64);
            assert!(
                (raw as f64) / (coded as f64) > 1.3,
                "{len}: {raw} raw bytes stored in {coded}"
            );
            // what the objects hold against what they take (kept as entries come and go; a debug build
            // checks it against a walk of the index)
            let (coded_n, stored_b, content_b) = s.content();
            assert_eq!((coded_n, content_b), (n, (n * len) as u64));
            assert_eq!(stored_b, coded);
            // the blocks the data takes shrink with it
            let raw_class = len.div_ceil(4096) * 4096;
            assert!(s.usage().1 < (n * raw_class) as u64, "{len}");
            assert_eq!(get_all(&s, &keys, &dst, len), vec![true; n]);
            assert!(same(&src, &dst, n, len), "{len}: one pass");
            assert_eq!(st.decoded_bytes.load(Ordering::Relaxed), (n * len) as u64);
            // two passes: before `between`, every object's first `first` bytes are decoded (the chunks that
            // cover them) and nothing past those chunks; after it, everything
            for first in [4096usize, len / 2, len] {
                let mut calls = 0;
                zero(&dst);
                let prefix = vec![first as u64; n];
                let covered = first.div_ceil(crate::codec::CHUNK) * crate::codec::CHUNK;
                let mut check = || {
                    calls += 1;
                    for i in 0..n {
                        assert!(
                            obj(&dst, i, len)[..first] == obj(&src, i, len)[..first],
                            "{len} {first}"
                        );
                        if covered < len {
                            assert!(
                                obj(&dst, i, len)[covered..].iter().all(|&b| b == 0),
                                "{len} {first}"
                            );
                        }
                    }
                };
                let batch = objs(&keys, &dst, len);
                // SAFETY: as above.
                let ok = unsafe { s.get_in_two(&batch, &prefix, &mut check) }.unwrap();
                assert_eq!((ok, calls), (vec![true; n], 1));
                assert!(same(&src, &dst, n, len), "{len}: two passes, {first}");
            }
            // the wrong length is a miss, as for any object
            let wrong = [(keys[0].as_str(), dst.as_ptr() as usize, len as u64 - 2)];
            // SAFETY: as above.
            assert_eq!(unsafe { s.get(&wrong) }.unwrap(), vec![false]);
            assert_eq!(s.len_of(&keys[0]), Some(len as u64));
            let rep = s.verify(false).unwrap();
            assert_eq!((rep.checked, rep.corrupt.len()), (n, 0));
            // a follower reads what the writer coded
            let r = PageStore::open_read_only(&root, "ns").unwrap();
            assert_eq!(get_all(&r, &keys, &dst, len), vec![true; n]);
            assert!(same(&src, &dst, n, len), "{len}: follower");
            // compaction writes the coded records again
            s.compact().unwrap();
        }
        // replay, with and without a codec configured: the records say what is coded
        for o in [coded_opts(), opts(1 << 30)] {
            let s = PageStore::open(&root, "ns", o).unwrap();
            assert_eq!(get_all(&s, &keys, &dst, len), vec![true; n]);
            assert!(same(&src, &dst, n, len), "{len}: reopened");
        }
        std::fs::remove_dir_all(root).unwrap();
    }
}

#[test]
fn incompressible_objects_are_stored_as_given() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let len = 1 << 20;
    let src = super::payload(2, len, 5); // xorshift bytes
    let dst = super::payload(2, len, 6);
    let keys: Vec<String> = vec!["a".into(), "b".into()];
    let s = PageStore::open(&root, "ns", coded_opts()).unwrap();
    assert_eq!(put_all(&s, &keys, &src, len), vec![true; 2]);
    assert_eq!(s.stats.encoded_bytes.load(Ordering::Relaxed), 0);
    assert_eq!(
        s.stats.bytes_written.load(Ordering::Relaxed),
        2 * len as u64
    );
    assert_eq!(get_all(&s, &keys, &dst, len), vec![true; 2]);
    assert!(same(&src, &dst, 2, len));
    drop(s);
    let j = std::fs::read(root.join(namespace_dir("ns")).join("journal.log")).unwrap();
    assert!(parse_resync(&j).records.iter().all(|r| match r {
        Record::Put { at, .. } => at.coded.is_none(),
        Record::Del { .. } => true,
    }));
    std::fs::remove_dir_all(root).unwrap();
}

/// Where object `key` lives: its data file and offset, and its stored length.
fn place(root: &Path, key: &str) -> (PathBuf, u64, u64) {
    let dir = root.join(namespace_dir("ns"));
    let j = std::fs::read(dir.join("journal.log")).unwrap();
    let at = parse_resync(&j)
        .records
        .into_iter()
        .rev()
        .find_map(|r| match r {
            Record::Put { key: k, at } if k == key => Some(at),
            _ => None,
        })
        .expect("a put record");
    assert!(at.coded.is_some(), "stored coded");
    (
        dir.join(format!("class-{}.dat", at.class)),
        u64::from(at.slot) * u64::from(at.class),
        at.len,
    )
}

/// Flips the bits `mask` of the byte at `at(stored length)` of the stored object `key` (synced); returns `at`.
fn flip_stored(root: &Path, key: &str, mask: u8, at: impl FnOnce(u64) -> u64) -> u64 {
    let (file, off, stored) = place(root, key);
    let at = at(stored);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, off + at).unwrap();
    f.write_all_at(&[b[0] ^ mask], off + at).unwrap();
    f.sync_all().unwrap();
    at
}

#[test]
fn damage_anywhere_in_a_coded_object_is_a_counted_miss() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let len = 3 * crate::codec::CHUNK + 1000;
    let src = kv_objects(1, len, 3);
    let dst = kv_objects(1, len, 4);
    let keys = vec!["p.k".to_owned()];
    // a byte of the header, of the chunk table, of a code table, of a stream, of a rest plane, the last
    for at in [2u64, 30, 60, 300, 40_000, 150_000, u64::MAX] {
        let root = tmp();
        let s = PageStore::open(&root, "ns", coded_opts()).unwrap();
        assert_eq!(put_all(&s, &keys, &src, len), vec![true]);
        let at = flip_stored(&root, "p.k", 0x10, |stored| at.min(stored - 1));
        let rep = s.verify(false).unwrap();
        assert_eq!(rep.corrupt, keys, "verify, damage at {at}");
        assert_eq!(get_all(&s, &keys, &dst, len), vec![false], "damage at {at}");
        assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1, "{at}");
        // dropped: a miss from now on, and a put stores it again
        assert_eq!(s.exists(&["p.k"]), vec![false]);
        assert_eq!(s.content(), (0, 0, 0));
        assert_eq!(put_all(&s, &keys, &src, len), vec![true]);
        assert_eq!(get_all(&s, &keys, &dst, len), vec![true]);
        assert!(same(&src, &dst, 1, len));
        drop(s);
        std::fs::remove_dir_all(root).unwrap();
    }
}

#[test]
fn a_decode_that_fails_after_the_stored_checksum_passed_is_never_served() {
    // What a decoder bug would look like: stored bytes whose checksum is right (the journal agrees with
    // them) but which do not decode to what was written. Made here by damaging a chunk and writing the
    // journal again with the damaged bytes' checksum.
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let len = 2 * crate::codec::CHUNK;
    let src = kv_objects(1, len, 8);
    let dst = kv_objects(1, len, 9);
    let keys = vec!["p.v".to_owned()];
    let root = tmp();
    {
        let s = PageStore::open(&root, "ns", coded_opts()).unwrap();
        assert_eq!(put_all(&s, &keys, &src, len), vec![true]);
    }
    let (file, off, stored) = place(&root, "p.v");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let mut b = vec![0u8; stored as usize];
    f.read_exact_at(&mut b, off).unwrap();
    // a byte of the first chunk's rest plane (its last bytes): decodes, to other values
    let h = crate::codec::Header::parse(&b).unwrap();
    let p = h.coded_end(1) - 10;
    b[p] ^= 0x01;
    f.write_all_at(&b, off).unwrap();
    f.sync_all().unwrap();
    let jp = root.join(namespace_dir("ns")).join("journal.log");
    let recs = parse_resync(&std::fs::read(&jp).unwrap()).records;
    let mut j = Vec::new();
    for mut r in recs {
        if let Record::Put { key, at } = &mut r {
            if key == "p.v" {
                at.crc = crate::hash::object_crc(&b, key);
            }
        }
        r.encode(&mut j);
    }
    std::fs::write(&jp, &j).unwrap();
    let s = PageStore::open(&root, "ns", coded_opts()).unwrap();
    assert_eq!(get_all(&s, &keys, &dst, len), vec![false]);
    assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1);
    assert_eq!(s.stats.decoded_bytes.load(Ordering::Relaxed), 0);
    assert_eq!(s.exists(&["p.v"]), vec![false], "dropped");
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn sealed_coded_objects_are_compressed_then_sealed() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    crate::seal::Keyring::init(&root.join("keys")).unwrap();
    let kr = Arc::new(crate::seal::Keyring::open(&root.join("keys")).unwrap());
    let len = 1 << 20;
    let n = 3;
    let src = kv_objects(n, len, 12);
    let dst = kv_objects(n, len, 13);
    let keys: Vec<String> = (0..n).map(|i| format!("t-{i}.k")).collect();
    let o = || StoreOptions {
        keyring: Some(kr.clone()),
        ..coded_opts()
    };
    {
        let s = PageStore::open(&root, "ns", o()).unwrap();
        assert_eq!(put_all(&s, &keys, &src, len), vec![true; n]);
        assert!(s.stats.bytes_written.load(Ordering::Relaxed) < (n * len) as u64 * 3 / 4);
        assert_eq!(get_all(&s, &keys, &dst, len), vec![true; n]);
        assert!(same(&src, &dst, n, len));
    }
    // what is on disk is sealed: not the codec's header, not the coded bytes
    let (file, off, stored) = place(&root, &kr.stored_name("t-0.k"));
    let mut b = vec![0u8; stored as usize];
    std::fs::File::open(&file)
        .unwrap()
        .read_exact_at(&mut b, off)
        .unwrap();
    assert!(!crate::codec::is_coded(&b));
    let s = PageStore::open(&root, "ns", o()).unwrap();
    assert_eq!(get_all(&s, &keys, &dst, len), vec![true; n]);
    assert!(same(&src, &dst, n, len), "reopened");
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_two_pass_read_of_a_coded_object_damaged_past_its_prefix_fails_whole() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let len = 4 * crate::codec::CHUNK;
    let src = kv_objects(1, len, 21);
    let dst = kv_objects(1, len, 22);
    let keys = vec!["p.k".to_owned()];
    let root = tmp();
    let s = PageStore::open(&root, "ns", coded_opts()).unwrap();
    assert_eq!(put_all(&s, &keys, &src, len), vec![true]);
    // the last byte of the stored object: in the last chunk, read by the second pass only
    flip_stored(&root, "p.k", 1, |stored| stored - 1);
    zero(&dst);
    let mut prefix_ok = false;
    let first = crate::codec::CHUNK;
    // SAFETY: as above.
    let ok = unsafe {
        s.get_in_two(&objs(&keys, &dst, len), &[first as u64], &mut || {
            prefix_ok = obj(&dst, 0, len)[..first] == obj(&src, 0, len)[..first];
        })
    }
    .unwrap();
    assert!(prefix_ok, "the first chunk was decoded before `between`");
    assert_eq!(ok, vec![false], "the whole object fails its check");
    assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1);
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_data_file_cut_inside_a_coded_objects_last_block_still_serves_it() {
    // its zero padding cut off (a copy or a tool that trims files): the object's own bytes are all there
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let len = crate::codec::CHUNK + 4096;
    let src = kv_objects(1, len, 31);
    let dst = kv_objects(1, len, 32);
    let keys = vec!["p.k".to_owned()];
    let root = tmp();
    {
        let s = PageStore::open(&root, "ns", coded_opts()).unwrap();
        assert_eq!(put_all(&s, &keys, &src, len), vec![true]);
    }
    let (file, off, stored) = place(&root, "p.k");
    assert!(stored % 4096 != 0, "the test needs a partial last block");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(off + stored)
        .unwrap();
    let s = PageStore::open_read_only(&root, "ns").unwrap();
    assert_eq!(get_all(&s, &keys, &dst, len), vec![true]);
    assert!(same(&src, &dst, 1, len));
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

//! Objects over [`crate::hash::PIECE`] bytes are read and summed in pieces on several IO workers: they read
//! back whole and exact, in one pass and in two, clear and sealed; a read error at any piece fails the
//! object (and drops nothing); damage in any piece fails it and drops it.

use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::fault::{self, Fault};
use crate::hash::PIECE;
use crate::store::*;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

/// Lengths around the piece edges: under one piece, one exactly, several and a tail, not 4 KiB-aligned.
const LENS: [usize; 5] = [
    PIECE - 1,
    PIECE,
    2 * PIECE + 1,
    3 * PIECE + 12_345,
    5 * PIECE,
];

fn bytes(r: &crate::buffer::HostRegion, len: usize) -> &[u8] {
    // SAFETY: the region owns at least `len` bytes, and no IO is in flight.
    unsafe { std::slice::from_raw_parts(r.as_ptr(), len) }
}

fn zero(r: &crate::buffer::HostRegion) {
    // SAFETY: the region owns its `len()` bytes, and no IO is in flight.
    unsafe { std::ptr::write_bytes(r.as_ptr(), 0, r.len()) };
}

#[test]
fn large_objects_read_back_exact_in_one_pass_and_in_two() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    for (n, &len) in LENS.iter().enumerate() {
        let src = payload(1, len, n as u8);
        let dst = payload(1, len, 0xEE);
        let key = format!("big-{n}");
        assert!(put1(&s, &key, src.as_ptr() as usize, len as u64));
        zero(&dst);
        assert!(get1(&s, &key, dst.as_ptr() as usize, len as u64), "{len}");
        assert!(
            bytes(&dst, len) == bytes(&src, len),
            "one pass, {len} bytes"
        );
        // two passes, the first ending inside a piece, on a piece edge, and at the end
        for first in [4096u64, PIECE as u64, PIECE as u64 + 4096, len as u64] {
            zero(&dst);
            let mut calls = 0;
            let obj = [(key.as_str(), dst.as_ptr() as usize, len as u64)];
            // SAFETY: the region is live, writable and only ours during the call.
            let ok = unsafe { s.get_in_two(&obj, &[first], &mut || calls += 1) }.unwrap();
            assert_eq!((ok, calls), (vec![true], 1), "{len} bytes, first {first}");
            assert!(
                bytes(&dst, len) == bytes(&src, len),
                "two passes, {len}, {first}"
            );
        }
    }
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_read_error_at_any_piece_fails_the_object_and_drops_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let s = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    let len = 3 * PIECE + 12_345; // four pieces: four reads
    let src = payload(1, len, 7);
    let dst = payload(1, len, 0);
    assert!(put1(&s, "k", src.as_ptr() as usize, len as u64));
    for skip in 0..4 {
        fault::set("data_read", skip, 1, Fault::Error(libc::EIO));
        let got = get1(&s, "k", dst.as_ptr() as usize, len as u64);
        let hits = fault::hits("data_read");
        fault::clear();
        assert!(!got, "a failed read of piece {skip} was served");
        assert_eq!(hits, 1, "piece {skip} was never read: no read of it failed");
        zero(&dst);
        assert!(
            get1(&s, "k", dst.as_ptr() as usize, len as u64),
            "dropped after an IO error"
        );
        assert!(bytes(&dst, len) == bytes(&src, len));
    }
    assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 0);
    drop(s);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn damage_in_any_piece_fails_the_object_and_drops_it() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let len = 3 * PIECE + 12_345;
    for at in [100, PIECE + 5, 2 * PIECE + 4095, len - 1] {
        for sealed in [false, true] {
            let root = tmp();
            let mut o = opts(1 << 30);
            if sealed {
                let ring = root.join("keyring");
                crate::seal::Keyring::init(&ring).unwrap();
                o.keyring = Some(std::sync::Arc::new(
                    crate::seal::Keyring::open(&ring).unwrap(),
                ));
            }
            let s = PageStore::open(&root, "ns", o).unwrap();
            let src = payload(1, len, 3);
            let dst = payload(1, len, 0);
            assert!(put1(&s, "k", src.as_ptr() as usize, len as u64));
            assert!(get1(&s, "k", dst.as_ptr() as usize, len as u64));
            assert!(bytes(&dst, len) == bytes(&src, len), "sealed {sealed}");
            let files = s.data_files();
            assert_eq!(files.len(), 1, "one object, one class file");
            // the object is the file's first slot: flip bits of the byte at `at` as stored
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&files[0])
                .unwrap();
            let mut b = [0u8];
            f.read_exact_at(&mut b, at as u64).unwrap();
            f.write_all_at(&[b[0] ^ 0x5A], at as u64).unwrap();
            f.sync_all().unwrap();
            assert!(
                !get1(&s, "k", dst.as_ptr() as usize, len as u64),
                "damage at {at} served"
            );
            assert_eq!(s.stats.corrupt_reads.load(Ordering::Relaxed), 1, "at {at}");
            assert!(
                !s.exists(&["k"])[0],
                "the damaged object was kept (at {at})"
            );
            drop(s);
            std::fs::remove_dir_all(root).unwrap();
        }
    }
}

//! What the page store's integrity costs: durable put and O_DIRECT get throughput of the same batches, in a
//! normal build (every object checksummed on put and verified on get) and in one built with
//! `--cfg kvtier_bench_unverified` (no checksum computed or checked; `benches/integrity_ab.sh` builds both and
//! alternates them), beside crc32c's own speed on one core over the same bytes (the store's, and the crc32c crate's).
//!
//! ```text
//! cargo bench -p kvtier-bench --bench integrity -- [--dir DIR] [--reps 7] [--io-threads 16]
//! ```
//!
//! Cases: 256 objects of 64 KiB, 32 of 1 MiB, 8 of 4.5 MiB (a MiMo-like K page), each a batch of fresh keys
//! per rep (every put reaches the disk), read back whole. Prints one line per case, then one JSON line.
use std::time::Instant;

use kvtier_core::buffer::{HostRegion, RegionOptions};
use kvtier_core::store::{PageStore, StoreOptions};

const CASES: [(usize, usize); 3] = [(64 << 10, 256), (1 << 20, 32), (4608 << 10, 8)];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let mut dir = std::env::temp_dir().join(format!("kvtier-integrity-{}", std::process::id()));
    let (mut reps, mut io_threads) = (7usize, 16usize);
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--dir" => dir = val().into(),
            "--reps" => reps = val().parse().expect("--reps: a number"),
            "--io-threads" => io_threads = val().parse().expect("--io-threads: a number"),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(
        reps > 0 && io_threads > 0,
        "--reps and --io-threads must be positive"
    );
    // (a build with --cfg kvtier_bench_unverified sums nothing: its checksum of anything is 0)
    let verified = kvtier_core::hash::object_crc(b"kvtier", "k") != 0;
    let mut rows = Vec::new();
    for (size, count) in CASES {
        let src = HostRegion::new(size * count, &RegionOptions::default()).expect("buffer");
        let dst = HostRegion::new(size * count, &RegionOptions::default()).expect("buffer");
        // SAFETY: the region owns its bytes; nothing else uses it yet.
        let bytes = unsafe { std::slice::from_raw_parts_mut(src.as_ptr(), src.len()) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(167) ^ (i >> 13) as u8;
        }
        let root = dir.join(format!("s{size}"));
        let _ = std::fs::remove_dir_all(&root);
        // (the defaults: 64 GiB, no budget, O_DIRECT where it works, no keyring)
        let opts = StoreOptions {
            io_threads,
            ..StoreOptions::default()
        };
        let store = PageStore::open(&root, "bench", opts).expect("store");
        let (mut put, mut get, mut crc, mut crate_crc) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let total = (size * count) as f64;
        for rep in 0..=reps {
            let keys: Vec<String> = (0..count).map(|i| format!("r{rep}-o{i}")).collect();
            let src_objs: Vec<(&str, usize, u64)> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.as_str(), src.as_ptr() as usize + i * size, size as u64))
                .collect();
            let dst_objs: Vec<(&str, usize, u64)> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k.as_str(), dst.as_ptr() as usize + i * size, size as u64))
                .collect();
            let t = Instant::now();
            // SAFETY: every range lies inside `src`, alive and unmodified during the call.
            let ok = unsafe { store.put(&src_objs) }.expect("put");
            let t_put = t.elapsed().as_secs_f64();
            assert!(ok.iter().all(|&b| b), "a put failed");
            let t = Instant::now();
            // SAFETY: every range lies inside `dst`, writable and used by nothing else during the call.
            let got = unsafe { store.get(&dst_objs) }.expect("get");
            let t_get = t.elapsed().as_secs_f64();
            assert!(got.iter().all(|&b| b), "a get failed");
            // SAFETY: both regions own `size * count` bytes.
            let same = unsafe {
                std::slice::from_raw_parts(src.as_ptr(), src.len())
                    == std::slice::from_raw_parts(dst.as_ptr(), dst.len())
            };
            assert!(same, "read back other bytes");
            // SAFETY: as above; zeroed so the next rep's get must really read.
            unsafe { std::ptr::write_bytes(dst.as_ptr(), 0, dst.len()) };
            // one core over the same bytes: the store's checksum (hash::bulk_crc, then the key), and the
            // crc32c crate's it replaced
            let time_crc = |crc: &dyn Fn(&[u8]) -> u32| {
                let t = Instant::now();
                let mut acc = 0u32;
                for (k, p, n) in &src_objs {
                    // SAFETY: inside `src`.
                    let b = unsafe { std::slice::from_raw_parts(*p as *const u8, *n as usize) };
                    acc ^= crc32c::crc32c_append(crc(b), k.as_bytes());
                }
                std::hint::black_box(acc);
                t.elapsed().as_secs_f64()
            };
            // (which goes first alternates by rep: the first pulls the bytes into the cache for the second)
            let (t_crc, t_crate) = if rep % 2 == 0 {
                let a = time_crc(&kvtier_core::hash::bulk_crc);
                (a, time_crc(&crc32c::crc32c))
            } else {
                let b = time_crc(&crc32c::crc32c);
                (time_crc(&kvtier_core::hash::bulk_crc), b)
            };
            if rep > 0 {
                // (the first rep warms the files and the threads)
                put.push(total / t_put / 1e9);
                get.push(total / t_get / 1e9);
                crc.push(total / t_crc / 1e9);
                crate_crc.push(total / t_crate / 1e9);
            }
        }
        drop(store);
        let _ = std::fs::remove_dir_all(&root);
        let (p, g, c, cc) = (median(put), median(get), median(crc), median(crate_crc));
        println!(
            "{:>5} KiB x {:>3}: put {p:6.2} GB/s  get {g:6.2} GB/s  crc32c one core {c:6.2} GB/s \
             (crc32c crate {cc:6.2})  ({})",
            size >> 10,
            count,
            if verified { "verified" } else { "unverified" }
        );
        rows.push(format!(
            "{{\"object_bytes\":{size},\"objects\":{count},\"put_gbps\":{p:.3},\"get_gbps\":{g:.3},\
             \"crc32c_gbps_one_core\":{c:.3},\"crc32c_crate_gbps_one_core\":{cc:.3}}}"
        ));
    }
    let _ = std::fs::remove_dir(&dir); // (only if empty: it may be a directory the caller owns)
    println!(
        "{{\"verified\":{verified},\"io_threads\":{io_threads},\"reps\":{reps},\"cases\":[{}]}}",
        rows.join(",")
    );
}

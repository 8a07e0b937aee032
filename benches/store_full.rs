//! The page store filling up and then full: put throughput, worst batch and journal compactions in each
//! phase, then the time to reopen the store and the index memory per object.
//!
//! ```text
//! cargo bench -p kvtier-bench --bench store_full -- [--pages 1000000] [--batch 1024] [--object 2048]
//!     [--capacity-gib 2] [--dir DIR] [--keep]
//! ```
//!
//! Each page is two objects, `<64 hex>.k` and `<64 hex>.v`, of `--object` bytes each, written with
//! `PageStore::put` in batches of `--batch` pages with fresh keys, so once the store holds `capacity` every
//! batch evicts. A batch belongs to the *filling* phase until the first one that evicts; every batch from
//! there on is *full*. Printed per phase: pages/s (pages over the phase's summed batch time), the median
//! and worst batch, and the compactions it did. Measured first on the same directory: the disk's
//! fdatasync latency (4 KiB write + fdatasync, 200 times) and what a batch's bytes cost without the store
//! (one buffered write of a batch's bytes + fdatasync, 100 times). Then the time to reopen the store (drop, open, per million
//! live objects) and the RSS the open index takes per live object (RSS with the store open minus after
//! it is dropped and `malloc_trim`). The store directory is removed at the end unless `--keep`; `--reopen-only`
//! then only times an open of that kept store (and the RSS the open took per live object). One JSON
//! line goes to stdout last. Only `open`, `put` and `stats` are used, so the same file builds against
//! older trees (`benches/store_full_before_after.sh`).
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvtier_core::buffer::{HostRegion, RegionOptions};
use kvtier_core::store::{PageStore, StoreOptions};

#[cfg(feature = "phases")]
#[path = "store_full_phases.rs"]
mod phases;

struct Args {
    pages: u64,
    batch: u64,
    object: u64,
    capacity: u64,
    dir: PathBuf,
    keep: bool,
    reopen_only: bool,
}

fn args() -> Args {
    let mut a = Args {
        pages: 1_000_000,
        batch: 1024,
        object: 2048,
        capacity: 2 << 30,
        dir: std::env::temp_dir().join(format!("kvtier-store-full-{}", std::process::id())),
        keep: false,
        reopen_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || {
            it.next()
                .unwrap_or_else(|| panic!("{k} needs a value"))
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("{k}: {e}"))
        };
        match k.as_str() {
            "--pages" => a.pages = val() as u64,
            "--batch" => a.batch = val() as u64,
            "--object" => a.object = val() as u64,
            "--capacity-gib" => a.capacity = (val() * (1u64 << 30) as f64) as u64,
            "--dir" => a.dir = PathBuf::from(it.next().expect("--dir needs a value")),
            "--keep" => a.keep = true,
            "--reopen-only" => a.reopen_only = true,
            "--bench" => {} // cargo bench passes it
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(
        a.pages > 0 && a.batch > 0 && a.object > 0,
        "sizes must be positive"
    );
    a
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// `size`-byte write + fdatasync latencies (ms), `n` times, on a scratch file in `dir`: median, p99, max.
fn fdatasync_ms(dir: &std::path::Path, size: usize, n: u64) -> (f64, f64, f64) {
    let p = dir.join("fdatasync-probe");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&p)
        .expect("probe file");
    let buf = vec![7u8; size];
    let mut t = Vec::new();
    for i in 0..n {
        let t0 = Instant::now();
        f.write_all_at(&buf, (i % 16) * size as u64)
            .expect("probe write");
        f.sync_data().expect("probe fdatasync");
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    drop(f);
    let _ = std::fs::remove_file(&p);
    t.sort_by(|a, b| a.total_cmp(b));
    (pct(&t, 0.5), pct(&t, 0.99), *t.last().unwrap())
}

#[derive(Default)]
struct Phase {
    pages: u64,
    secs: f64,
    batches: Vec<f64>,
    compactions: u64,
}

impl Phase {
    fn json(&mut self, name: &str) -> String {
        self.batches.sort_by(|a, b| a.total_cmp(b));
        let rate = if self.secs > 0.0 {
            self.pages as f64 / self.secs
        } else {
            0.0
        };
        println!(
            "{name:8} {:>6} batches {:>9.0} pages/s  batch median {:6.1} ms  p99 {:6.1} ms  worst {:6.1} ms  compactions {}",
            self.batches.len(),
            rate,
            pct(&self.batches, 0.5),
            pct(&self.batches, 0.99),
            self.batches.last().copied().unwrap_or(0.0),
            self.compactions
        );
        format!(
            "\"{name}\":{{\"batches\":{},\"pages_per_s\":{:.0},\"batch_median_ms\":{:.2},\"batch_p99_ms\":{:.2},\"worst_batch_ms\":{:.2},\"compactions\":{}}}",
            self.batches.len(),
            rate,
            pct(&self.batches, 0.5),
            pct(&self.batches, 0.99),
            self.batches.last().copied().unwrap_or(0.0),
            self.compactions
        )
    }
}

/// `--reopen-only`: times an open of the store a `--keep` run left in `--dir` (kept).
fn reopen_only(a: &Args) {
    let opts = StoreOptions {
        capacity_bytes: a.capacity,
        ..StoreOptions::default()
    };
    let rss0 = rss_bytes();
    let t0 = Instant::now();
    let store = PageStore::open(&a.dir, "bench", opts).expect("reopen");
    let reopen = t0.elapsed().as_secs_f64();
    let rss1 = rss_bytes();
    let live = store.usage().0 as f64;
    println!(
        "reopen {reopen:.2} s for {live} objects ({:.2} s per million), index RSS {:.0} bytes per object",
        reopen / (live.max(1.0) / 1e6),
        rss1.saturating_sub(rss0) as f64 / live.max(1.0)
    );
    #[cfg(feature = "phases")]
    phases::print_open(&store);
}

fn main() {
    let a = args();
    if a.reopen_only {
        return reopen_only(&a);
    }
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.dir).expect("bench dir");
    let (sync_med, sync_p99, sync_max) = fdatasync_ms(&a.dir, 4096, 200);
    // what one batch's data costs the disk alone: its bytes written (buffered) and synced
    let batch_bytes = (a.batch * 2 * a.object) as usize;
    let (io_med, io_p99, io_max) = fdatasync_ms(&a.dir, batch_bytes, 100);
    println!(
        "{} pages x (K {} + V {} bytes), batches of {}, capacity {:.2} GiB, dir {}",
        a.pages,
        a.object,
        a.object,
        a.batch,
        a.capacity as f64 / (1u64 << 30) as f64,
        a.dir.display()
    );
    println!(
        "fdatasync (4 KiB): median {sync_med:.2} ms  p99 {sync_p99:.2} ms  max {sync_max:.2} ms"
    );
    println!(
        "a batch's bytes ({:.1} MiB) written + fdatasync, no store: median {io_med:.1} ms  p99 {io_p99:.1} ms  max {io_max:.1} ms",
        batch_bytes as f64 / (1u64 << 20) as f64
    );
    let opts = StoreOptions {
        capacity_bytes: a.capacity,
        budget_bytes: None,
        io_threads: 16,
        direct: None,
        keyring: None,
        codec: None,
    };
    let per_batch = (a.batch * 2) as usize;
    let buf =
        HostRegion::new(per_batch * a.object as usize, &RegionOptions::default()).expect("buffer");
    // SAFETY: the region owns its bytes; filled once with a pattern.
    unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) }
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i * 31 % 251) as u8);
    let store = PageStore::open(&a.dir, "bench", opts.clone()).expect("open");
    let (mut fill, mut full) = (Phase::default(), Phase::default());
    let mut failed = 0u64;
    let mut page = 0u64;
    let t_all = Instant::now();
    #[cfg(feature = "phases")]
    let mut phases = phases::Phases::default();
    while page < a.pages {
        let n = a.batch.min(a.pages - page);
        let keys: Vec<String> = (page..page + n)
            .flat_map(|p| [format!("{p:064x}.k"), format!("{p:064x}.v")])
            .collect();
        let objs: Vec<(&str, usize, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                (
                    k.as_str(),
                    buf.as_ptr() as usize + i * a.object as usize,
                    a.object,
                )
            })
            .collect();
        let (ev0, c0) = (
            store.stats.evictions.load(Ordering::Relaxed),
            store.stats.compactions.load(Ordering::Relaxed),
        );
        #[cfg(feature = "phases")]
        phases.start(&store);
        let t0 = Instant::now();
        // SAFETY: every object lies inside `buf`, alive and unmodified for the call.
        let ok = unsafe { store.put(&objs) }.expect("put");
        let dt = t0.elapsed().as_secs_f64();
        #[cfg(feature = "phases")]
        phases.end(&store, dt * 1e3);
        failed += ok.iter().filter(|&&x| !x).count() as u64;
        let evicted = store.stats.evictions.load(Ordering::Relaxed) > ev0;
        let ph = if evicted || !full.batches.is_empty() {
            &mut full
        } else {
            &mut fill
        };
        ph.pages += n;
        ph.secs += dt;
        ph.batches.push(dt * 1e3);
        ph.compactions += store.stats.compactions.load(Ordering::Relaxed) - c0;
        page += n;
    }
    let total_s = t_all.elapsed().as_secs_f64();
    let live = store.usage().0 as u64;
    let jlen = std::fs::metadata(store.dir().join("journal.log"))
        .map(|m| m.len())
        .unwrap_or(0);
    println!("{} pages put in {total_s:.1} s, {failed} objects failed, {live} objects live, journal {:.1} MB", a.pages, jlen as f64 / 1e6);
    #[cfg(feature = "phases")]
    phases.print(&store, io_max);
    let fj = fill.json("filling");
    let uj = full.json("full");
    drop(store);
    // SAFETY: malloc_trim only releases free heap memory back to the OS.
    unsafe { libc::malloc_trim(0) };
    let rss0 = rss_bytes();
    let t0 = Instant::now();
    let store = PageStore::open(&a.dir, "bench", opts).expect("reopen");
    let reopen = t0.elapsed().as_secs_f64();
    let rss1 = rss_bytes();
    let relive = store.usage().0 as u64;
    assert_eq!(
        relive, live,
        "the reopened store holds what the open one did"
    );
    let per_m = reopen / (relive.max(1) as f64 / 1e6);
    let per_obj = rss1.saturating_sub(rss0) as f64 / relive.max(1) as f64;
    println!(
        "reopen {reopen:.2} s for {relive} objects ({per_m:.2} s per million; compacted at open: {}), index RSS {per_obj:.0} bytes per object",
        store.open_report().compacted
    );
    #[cfg(feature = "phases")]
    phases::print_open(&store);
    drop(store);
    if !a.keep {
        let _ = std::fs::remove_dir_all(&a.dir);
    }
    println!(
        "{{\"pages\":{},\"batch\":{},\"object_bytes\":{},\"capacity\":{},\"failed_objects\":{failed},\"live_objects\":{live},\"journal_bytes\":{jlen},{fj},{uj},\"reopen_s\":{reopen:.3},\"reopen_s_per_million\":{per_m:.3},\"index_rss_bytes_per_object\":{per_obj:.0},\"fdatasync_ms\":{{\"median\":{sync_med:.3},\"p99\":{sync_p99:.3},\"max\":{sync_max:.3}}},\"batch_bytes_write_sync_ms\":{{\"median\":{io_med:.2},\"p99\":{io_p99:.2},\"max\":{io_max:.2}}}}}",
        a.pages, a.batch, a.object, a.capacity
    );
}

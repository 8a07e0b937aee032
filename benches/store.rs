//! Page store write (durable) and read (O_DIRECT) throughput by object size and queue depth.
//!
//! `cargo bench -p kvtier-bench --bench store`; set `KVTIER_BENCH_DIR` to measure a particular disk (default:
//! a directory under the system temp dir). Each iteration writes a batch of fresh keys (so every write
//! really hits the disk) or reads the batch back.
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtier_core::buffer::{HostRegion, RegionOptions};
use kvtier_core::store::{PageStore, StoreOptions};

static NEXT: AtomicU64 = AtomicU64::new(0);

fn store_bench(c: &mut Criterion) {
    let root = std::env::var_os("KVTIER_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("kvtier-bench-store-{}", std::process::id()))
        });
    let mut g = c.benchmark_group("page_store");
    g.sample_size(10);
    for &(size, count) in &[(64usize << 10, 256usize), (4608 << 10, 16)] {
        let buf = HostRegion::new(size * count, &RegionOptions::default()).expect("buffer");
        for &qd in &[1usize, 4, 16] {
            let dir = root.join(format!("s{size}-q{qd}"));
            let _ = std::fs::remove_dir_all(&dir);
            let store = PageStore::open(
                &dir,
                "bench",
                StoreOptions {
                    io_threads: qd,
                    ..StoreOptions::default()
                },
            )
            .expect("store");
            g.throughput(Throughput::Bytes((size * count) as u64));
            let id = format!("{}KiB-x{count}-qd{qd}", size >> 10);
            let mut last: Vec<String> = Vec::new();
            g.bench_function(BenchmarkId::new("write", &id), |b| {
                b.iter(|| {
                    let base = NEXT.fetch_add(count as u64, Ordering::Relaxed);
                    last = (0..count as u64)
                        .map(|i| format!("k{}", base + i))
                        .collect();
                    let objs: Vec<(&str, usize, u64)> = last
                        .iter()
                        .enumerate()
                        .map(|(i, k)| (k.as_str(), buf.as_ptr() as usize + i * size, size as u64))
                        .collect();
                    // SAFETY: every object lies inside `buf`, alive for the call.
                    let ok = unsafe { store.put(&objs) }.expect("put");
                    assert!(ok.iter().all(|&x| x));
                })
            });
            g.bench_function(BenchmarkId::new("read", &id), |b| {
                b.iter(|| {
                    let objs: Vec<(&str, usize, u64)> = last
                        .iter()
                        .enumerate()
                        .map(|(i, k)| (k.as_str(), buf.as_ptr() as usize + i * size, size as u64))
                        .collect();
                    // SAFETY: disjoint destinations inside `buf`.
                    let ok = unsafe { store.get(&objs) }.expect("get");
                    assert!(ok.iter().all(|&x| x));
                })
            });
            drop(store);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    g.finish();
    let _ = std::fs::remove_dir_all(&root);
}

criterion_group!(benches, store_bench);
criterion_main!(benches);

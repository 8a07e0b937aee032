//! Host buffer create + pre-fault throughput, the cost a pool pays once at start-up.
//!
//! `cargo bench -p kvtier-bench --bench buffer`. Sizes default to 1 and 8 GiB; set `KVTIER_BENCH_SMALL=1`
//! to use 64 and 256 MiB on small machines.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtier_core::buffer::{HostRegion, HugePages, RegionOptions};

fn create_prefault(c: &mut Criterion) {
    let small = std::env::var_os("KVTIER_BENCH_SMALL").is_some();
    let sizes: &[usize] = if small {
        &[64 << 20, 256 << 20]
    } else {
        &[1 << 30, 8 << 30]
    };
    let mut g = c.benchmark_group("host_region_create_prefault");
    g.sample_size(10);
    for &n in sizes {
        g.throughput(Throughput::Bytes(n as u64));
        for (label, hp) in [("base", HugePages::Off), ("thp", HugePages::Transparent)] {
            g.bench_with_input(
                BenchmarkId::new(label, format!("{}MiB", n >> 20)),
                &n,
                |b, &n| {
                    let opts = RegionOptions {
                        huge_pages: hp,
                        ..Default::default()
                    };
                    b.iter(|| HostRegion::new(n, &opts).expect("allocation"));
                },
            );
        }
    }
    g.finish();
}

criterion_group!(benches, create_prefault);
criterion_main!(benches);

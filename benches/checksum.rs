//! The checksum's speed on one core: kvtier's (`hash::bulk_crc`, crc-fast) against the `crc32c` crate it
//! replaced, on bytes in the core's L2 (256 KiB summed 4,000 times) and on 64 MiB (from memory), each
//! implementation first in turn, medians of 5.
//!
//! ```text
//! cargo bench -p kvtier-bench --bench checksum
//! ```
use std::time::Instant;

fn rate(f: &dyn Fn(&[u8]) -> u32, chunks: &[&[u8]], times: usize) -> f64 {
    let t = Instant::now();
    let mut s = 0u32;
    for _ in 0..times {
        for c in chunks {
            s ^= f(c);
        }
    }
    std::hint::black_box(s);
    let bytes: usize = chunks.iter().map(|c| c.len()).sum();
    (times * bytes) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut v = vec![0u8; 64 << 20];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in v.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let ours = |b: &[u8]| kvtier_core::hash::bulk_crc(b);
    let crate_ = |b: &[u8]| crc32c::crc32c(b);
    let mut rows = Vec::new();
    for (place, total, chunk, times) in [
        ("L2", 256usize << 10, 4096usize, 4000usize),
        ("L2", 256 << 10, 65536, 4000),
        ("memory", 64 << 20, 65536, 8),
        ("memory", 64 << 20, 1 << 20, 8),
    ] {
        let chunks: Vec<&[u8]> = v[..total].chunks_exact(chunk).collect();
        for c in &chunks[..4] {
            assert_eq!(ours(c), crate_(c), "the two checksums differ");
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for r in 0..5 {
            if r % 2 == 0 {
                a.push(rate(&ours, &chunks, times));
                b.push(rate(&crate_, &chunks, times));
            } else {
                b.push(rate(&crate_, &chunks, times));
                a.push(rate(&ours, &chunks, times));
            }
        }
        let (a, b) = (median(a), median(b));
        println!(
            "{place:>6}, {:>5} KiB chunks: kvtier {a:6.1} GB/s  crc32c crate {b:6.1} GB/s  ({:.2}x)",
            chunk >> 10,
            a / b
        );
        rows.push(format!(
            "{{\"bytes_in\":\"{place}\",\"chunk\":{chunk},\"kvtier_gbps\":{a:.2},\"crc32c_crate_gbps\":{b:.2}}}"
        ));
    }
    println!("{{\"one_core\":[{}]}}", rows.join(","));
}

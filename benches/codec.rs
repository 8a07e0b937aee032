//! The page codec (`kvtier_core::codec`) against the disk it sits in front of: its ratio, and its encode
//! and decode rates on 1, 2 and 4 threads (decoded bytes a second), each as a ratio to the disk's own
//! O_DIRECT write and read rates measured in the same run (`roofline::odirect_roofline`, objects of the
//! input's object size, 16 in flight). Medians of 5.
//!
//! ```text
//! cargo bench -p kvtier-bench --bench codec                       # KV-like synthetic bf16 (labelled so)
//! KVTIER_CODEC_INPUT=k.bin KVTIER_CODEC_ELEM=bits16 KVTIER_CODEC_OBJECT=294912 \
//!     cargo bench -p kvtier-bench --bench codec                   # real KV (benches/python/real_kv.py --dump)
//! KVTIER_BENCH_DIR=/mnt/disk ...                                  # where the disk ceiling is measured
//! ```
//!
//! Prints one JSON line per input, for RESULTS.md.
use std::time::Instant;

use kvtier_core::codec::{self, Elem};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Synthetic KV-shaped bf16: 128 channels, each with a scale exp(N(0,1)), values N(0,1) × scale.
fn synthetic(bytes: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut normal = move || {
        let (u, v) = (next().max(1e-300), next());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    };
    let scales: Vec<f64> = (0..128).map(|_| normal().exp()).collect();
    let mut out = Vec::with_capacity(bytes);
    for i in 0..bytes / 2 {
        let b = (((normal() * scales[i % 128]) as f32).to_bits() >> 16) as u16;
        out.extend_from_slice(&b.to_le_bytes());
    }
    out
}

/// Decoded bytes a second of `f` over `objects` on `threads` threads (each object to one thread at a time).
fn rate(threads: usize, objects: usize, obj_bytes: usize, f: &(dyn Fn(usize) + Sync)) -> f64 {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= objects {
                    break;
                }
                f(i);
            });
        }
    });
    (objects * obj_bytes) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let elem = std::env::var("KVTIER_CODEC_ELEM")
        .ok()
        .map(|e| Elem::parse(&e).expect("KVTIER_CODEC_ELEM: bits16 or bits8"))
        .unwrap_or(Elem::Bits16);
    let (label, data) = match std::env::var("KVTIER_CODEC_INPUT") {
        Ok(p) => (
            p.clone(),
            std::fs::read(&p).expect("KVTIER_CODEC_INPUT: a file of raw KV bytes"),
        ),
        Err(_) => (
            "synthetic KV-shaped bf16 (not real KV)".to_owned(),
            synthetic(64 << 20),
        ),
    };
    let obj = std::env::var("KVTIER_CODEC_OBJECT")
        .ok()
        .map(|s| s.parse::<usize>().expect("KVTIER_CODEC_OBJECT: bytes"))
        .unwrap_or(4 << 20)
        .min(data.len());
    let objects: Vec<&[u8]> = data.chunks_exact(obj).collect();
    assert!(!objects.is_empty(), "input shorter than one object");
    // enough work per timing: repeat the objects to at least 256 MiB
    let reps = (256usize << 20).div_ceil(objects.len() * obj).max(1);
    let work = objects.len() * reps;
    let coded: Vec<Vec<u8>> = objects
        .iter()
        .map(|o| {
            let mut c = Vec::new();
            codec::encode(o, elem, &mut c);
            c
        })
        .collect();
    for (o, c) in objects.iter().zip(&coded) {
        let mut out = vec![0u8; o.len()];
        codec::decode(c, &mut out).expect("decodes");
        assert!(out == *o, "round trip differs");
    }
    let stored: usize = coded.iter().map(Vec::len).sum();
    let ratio = (objects.len() * obj) as f64 / stored as f64;
    let dir = std::env::var("KVTIER_BENCH_DIR")
        .unwrap_or_else(|_| std::env::temp_dir().display().to_string());
    let size = obj.div_ceil(4096) * 4096;
    let count = ((512usize << 20) / size).max(16);
    let (mut dw, mut dr) = (Vec::new(), Vec::new());
    let mut row = String::new();
    let mut enc = vec![Vec::new(); 3];
    let mut dec = vec![Vec::new(); 3];
    let outs: Vec<std::sync::Mutex<Vec<u8>>> = (0..16)
        .map(|_| std::sync::Mutex::new(vec![0u8; obj]))
        .collect();
    for _ in 0..5 {
        let (w, r, _) =
            kvtier_core::roofline::odirect_roofline(std::path::Path::new(&dir), size, count, 16)
                .expect("disk ceiling");
        dw.push(w);
        dr.push(r);
        for (k, threads) in [1usize, 2, 4].into_iter().enumerate() {
            enc[k].push(rate(threads, work, obj, &|i| {
                let mut c = Vec::with_capacity(codec::max_encoded_len(obj));
                codec::encode(objects[i % objects.len()], elem, &mut c);
                std::hint::black_box(c);
            }));
            dec[k].push(rate(threads, work, obj, &|i| {
                let mut out = outs[i % 16].lock().expect("not poisoned");
                codec::decode(&coded[i % coded.len()], &mut out).expect("decodes");
            }));
        }
    }
    let (dw, dr) = (median(dw), median(dr));
    println!(
        "input: {label} ({} objects of {obj} bytes, {elem:?})",
        objects.len()
    );
    println!("ratio {ratio:.3} ({:.2} bits a 16-bit value)", 16.0 / ratio);
    println!("disk (same run, {dir}): write {dw:.2} GB/s, read {dr:.2} GB/s");
    for (k, threads) in [1usize, 2, 4].into_iter().enumerate() {
        let (e, d) = (median(enc[k].clone()), median(dec[k].clone()));
        println!(
            "{threads} thread(s): encode {e:.2} GB/s = {:.2}x disk write; decode {d:.2} GB/s = {:.2}x disk read",
            e / dw,
            d / dr
        );
        row.push_str(&format!(
            "\"threads_{threads}\": {{\"encode_GBps\": {e:.3}, \"decode_GBps\": {d:.3}, \"encode_x_disk_write\": {:.3}, \"decode_x_disk_read\": {:.3}}}, ",
            e / dw,
            d / dr
        ));
    }
    println!(
        "{{\"input\": {label:?}, \"elem\": \"{}\", \"object_bytes\": {obj}, \"ratio\": {ratio:.4}, \"disk_write_GBps\": {dw:.3}, \"disk_read_GBps\": {dr:.3}, {}\"cpus\": {}}}",
        elem.name(),
        row,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}

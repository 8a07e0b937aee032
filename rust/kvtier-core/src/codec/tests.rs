use super::*;
use proptest::prelude::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-300), self.unit());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// bf16 values shaped like KV: each of `dims` channels has a scale exp(N(0,1)), values N(0,1) × scale.
pub(crate) fn kv_like_bf16(values: usize, dims: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    let scales: Vec<f64> = (0..dims).map(|_| r.normal().exp()).collect();
    let mut out = Vec::with_capacity(values * 2);
    for i in 0..values {
        let x = (r.normal() * scales[i % dims]) as f32;
        let b = (x.to_bits() >> 16) as u16; // bf16 by truncation
        out.extend_from_slice(&b.to_le_bytes());
    }
    out
}

fn fp8_like(values: usize, seed: u64) -> Vec<u8> {
    // e4m3-like: a normal value's exponent (biased 7) and 3 mantissa bits
    let mut r = Rng(seed | 1);
    (0..values)
        .map(|_| {
            let x = r.normal();
            let e = (x.abs().max(1e-3).log2().floor() as i32 + 7).clamp(0, 15) as u8;
            let m = (r.next() & 7) as u8;
            ((x < 0.0) as u8) << 7 | e << 3 | m
        })
        .collect()
}

fn round_trip(raw: &[u8], elem: Elem) -> usize {
    let mut coded = Vec::new();
    let n = encode(raw, elem, &mut coded);
    assert_eq!(n, coded.len());
    assert!(
        n <= max_encoded_len(raw.len()),
        "{n} > bound for {}",
        raw.len()
    );
    let mut out = vec![0xa5u8; raw.len()];
    decode(&coded, &mut out).expect("decodes");
    assert!(
        out == raw,
        "round trip of {} bytes ({elem:?}) differs",
        raw.len()
    );
    n
}

#[test]
fn kv_like_bf16_shrinks_and_round_trips() {
    let raw = kv_like_bf16(1 << 20, 128, 7); // 2 MiB: 8 chunks
    let n = round_trip(&raw, Elem::Bits16);
    let ratio = raw.len() as f64 / n as f64;
    // per-channel log-normal scales: the exponent plane takes ~3.2 bits, so about 16 / 11.2
    assert!(ratio > 1.35, "ratio {ratio:.3}");
}

#[test]
fn fp8_like_shrinks_and_round_trips() {
    let raw = fp8_like(600_000, 3);
    let n = round_trip(&raw, Elem::Bits8);
    assert!(raw.len() as f64 / n as f64 > 1.1, "{n}");
}

#[test]
fn every_length_and_shape_round_trips() {
    let mut r = Rng(99);
    let big = kv_like_bf16(2 * CHUNK, 64, 5);
    for len in (0..300).chain([CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3, 2 * CHUNK]) {
        for elem in [Elem::Bits16, Elem::Bits8] {
            round_trip(&big[..len], elem);
            let noise: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
            round_trip(&noise, elem);
            round_trip(&vec![0u8; len], elem);
            round_trip(&vec![0x3fu8; len], elem);
        }
    }
}

#[test]
fn what_does_not_shrink_is_stored_raw_and_costs_only_the_header() {
    let mut r = Rng(5);
    let noise: Vec<u8> = (0..3 * CHUNK).map(|_| r.next() as u8).collect();
    let n = round_trip(&noise, Elem::Bits16);
    assert_eq!(n, HEADER + 3 * 8 + 3 + noise.len());
}

#[test]
fn encode_shrinking_gives_up_on_bytes_that_are_not_values() {
    let mut r = Rng(17);
    let noise: Vec<u8> = (0..3 * CHUNK).map(|_| r.next() as u8).collect();
    let mut out = vec![7u8; 3];
    assert_eq!(encode_shrinking(&noise, Elem::Bits16, &mut out), None);
    assert_eq!(out, vec![7u8; 3], "left as it was");
    let kv = kv_like_bf16(CHUNK, 64, 3);
    let n = encode_shrinking(&kv, Elem::Bits16, &mut out).expect("KV shrinks");
    let mut back = vec![0u8; kv.len()];
    decode(&out[3..3 + n], &mut back).unwrap();
    assert!(back == kv);
}

#[test]
fn zero_pages_shrink_to_a_plane() {
    let n = round_trip(&vec![0u8; 4 * CHUNK], Elem::Bits16);
    // the rest plane (half the bytes) is stored; the symbol plane is one byte a chunk
    assert!(n < 2 * CHUNK + 128, "{n}");
    // (fp8: the nibble plane, half the bytes, is stored too)
    assert!(round_trip(&vec![0u8; 4 * CHUNK], Elem::Bits8) < 2 * CHUNK + 128);
}

#[test]
fn two_symbols_and_skewed_counts_make_complete_limited_codes() {
    // Fibonacci counts force a deep tree: the limit must hold and the code stay complete
    let mut counts = [0u64; 256];
    let (mut a, mut b) = (1u64, 1u64);
    for c in counts.iter_mut().take(40) {
        *c = a;
        (a, b) = (b, a + b);
    }
    let lens = huffman::lengths(&counts).expect("40 symbols");
    assert!(lens.iter().all(|&l| u32::from(l) <= huffman::MAX_LEN));
    let kraft: u64 = lens
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| 1u64 << (huffman::MAX_LEN - u32::from(l)))
        .sum();
    assert_eq!(kraft, 1 << huffman::MAX_LEN);
    let mut t = Vec::new();
    huffman::write_table(&lens, &mut t);
    assert_eq!(huffman::read_table(&t), Some(lens));
    // and the data those counts describe round-trips
    let mut syms = Vec::new();
    for (s, &c) in counts.iter().enumerate().take(24) {
        syms.extend(std::iter::repeat_n(s as u8, c as usize));
    }
    round_trip(&syms, Elem::Bits8);
    round_trip(&[1, 2, 1, 1, 2, 2, 2, 1, 1], Elem::Bits8);
}

#[test]
fn a_header_of_another_chunk_size_is_refused() {
    // a crafted header could otherwise claim 2^32 chunks of 4 GiB each
    let mut coded = Vec::new();
    encode(&kv_like_bf16(1000, 8, 1), Elem::Bits16, &mut coded);
    assert!(Header::parse(&coded).is_ok());
    for chunk in [2u32, CHUNK as u32 * 2, u32::MAX - 1] {
        let mut bad = coded.clone();
        bad[16..20].copy_from_slice(&chunk.to_le_bytes());
        assert!(Header::parse(&bad).is_err(), "{chunk}");
    }
}

#[test]
fn incomplete_or_overlong_tables_are_refused() {
    let mut lens = [0u8; 256];
    lens[0] = 1;
    let mut t = Vec::new();
    huffman::write_table(&lens, &mut t);
    assert_eq!(huffman::read_table(&t), None); // one symbol: incomplete
    lens[1] = 2;
    let mut t = Vec::new();
    huffman::write_table(&lens, &mut t);
    assert_eq!(huffman::read_table(&t), None); // 1/2 + 1/4
    let t = vec![0xffu8; huffman::TABLE_BYTES]; // lengths of 15
    assert_eq!(huffman::read_table(&t), None);
}

#[test]
fn a_damaged_object_never_decodes_to_wrong_bytes() {
    let raw = kv_like_bf16(CHUNK / 2 + 17, 64, 11); // two chunks, the second short
    let mut coded = Vec::new();
    encode(&raw, Elem::Bits16, &mut coded);
    let mut r = Rng(123);
    let mut out = vec![0u8; raw.len()];
    let mut refused = 0;
    // every byte of the header and chunk table, then positions across the data
    let positions: Vec<usize> = (0..HEADER + 16)
        .chain((0..1500).map(|_| (r.next() as usize) % coded.len()))
        .collect();
    for p in positions {
        let mut bad = coded.clone();
        bad[p] ^= 1 << (r.next() % 8);
        match decode(&bad, &mut out) {
            Ok(()) => assert!(out == raw, "damage at {p} decoded to other bytes"),
            Err(_) => refused += 1,
        }
    }
    assert!(refused > 1450, "{refused}");
    // cut anywhere
    for cut in (0..coded.len()).step_by(331) {
        assert!(decode(&coded[..cut], &mut out).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..4096), len in 0usize..5000) {
        let mut out = vec![0u8; len];
        let _ = decode(&b, &mut out);
        if let Ok(h) = Header::parse(&b) {
            for c in 0..h.chunks() {
                let mut o = vec![0u8; h.raw_range(c).len().min(1 << 20)];
                let _ = h.decode_chunk(&b, c, &mut o);
            }
        }
    }

    #[test]
    fn mutated_objects_never_panic(seed in any::<u64>(), flips in 1usize..8, elem16 in any::<bool>()) {
        let elem = if elem16 { Elem::Bits16 } else { Elem::Bits8 };
        let raw = kv_like_bf16(20_000, 32, seed);
        let mut coded = Vec::new();
        encode(&raw, elem, &mut coded);
        let mut r = Rng(seed | 1);
        for _ in 0..flips {
            let p = (r.next() as usize) % coded.len();
            coded[p] = r.next() as u8;
        }
        let mut out = vec![0u8; raw.len()];
        if decode(&coded, &mut out).is_ok() {
            prop_assert!(out == raw);
        }
    }

    #[test]
    fn any_bytes_round_trip(b in proptest::collection::vec(any::<u8>(), 0..3000), elem16 in any::<bool>()) {
        let elem = if elem16 { Elem::Bits16 } else { Elem::Bits8 };
        round_trip(&b, elem);
    }
}

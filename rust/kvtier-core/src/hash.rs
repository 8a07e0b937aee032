//! SHA-256 page keys, byte-compatible with SGLang HiCache's chained page hashes: page i's key is
//! `sha256(bytes.fromhex(key[i-1]) ‖ tokens of page i as 4-byte little-endian)` in lowercase hex, with no
//! prefix for page 0 unless a prior hash is given. A trailing partial page is hashed like a full one over
//! the tokens it has, as SGLang's `get_hash_str` does (HiCache itself only stores full pages).

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Lowercase hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

fn hex(b: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(D[(x >> 4) as usize] as char);
        s.push(D[(x & 15) as usize] as char);
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    // bytes, not string slices: a multi-byte character must be refused, not split (which panics); and
    // only hex digits count (`from_str_radix` would also take a leading '+')
    fn digit(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks_exact(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// Chained page keys of `tokens` (each a u32 token id) with `page_size` tokens a page (the last page may be
/// partial).
pub fn page_hashes(tokens: &[u32], page_size: usize, prior: Option<&str>) -> Result<Vec<String>> {
    if page_size == 0 {
        return Err(Error::arg("page_size", "must be positive, got 0"));
    }
    let mut prev = match prior {
        Some(p) => Some(
            unhex(p)
                .ok_or_else(|| Error::arg("prior_hash", format!("{p:?} is not a hex string")))?,
        ),
        None => None,
    };
    let mut out = Vec::with_capacity(tokens.len().div_ceil(page_size));
    for page in tokens.chunks(page_size) {
        let mut h = Sha256::new();
        if let Some(p) = &prev {
            h.update(p);
        }
        for t in page {
            h.update(t.to_le_bytes());
        }
        let d = h.finalize();
        out.push(hex(&d));
        prev = Some(d.to_vec());
    }
    Ok(out)
}

/// The checksum that binds an object's bytes to its key: crc32c of the bytes followed by the key, as the
/// page store keeps it in its journal and the cluster tier in its records. Built with
/// `RUSTFLAGS="--cfg kvtier_bench_unverified"` (only `benches/integrity_ab.sh` does, in a target directory
/// of its own) it is 0 without reading the bytes, so that run measures the tiers without verification;
/// no feature or option of a normal build turns it off.
#[inline]
pub fn object_crc(bytes: &[u8], key: &str) -> u32 {
    #[cfg(kvtier_bench_unverified)]
    {
        let _ = (bytes, key);
        0
    }
    #[cfg(not(kvtier_bench_unverified))]
    {
        crc32c::crc32c_append(bulk_crc(bytes), key.as_bytes())
    }
}

/// crc32c of `bytes`, by `crc-fast` (folding with carry-less multiplies on the widest vectors the CPU has,
/// chosen at run time: 2.1-3.2x the `crc32c` crate's hardware-crc32 loop on bytes in cache, level with it
/// where one core's memory bandwidth is the limit, `benches/RESULTS.md` §2). The same polynomial and result
/// as `crc32c::crc32c`; journals and records written before read the same. Public for the integrity and
/// checksum benches, which time it in every build.
#[inline]
pub fn bulk_crc(bytes: &[u8]) -> u32 {
    // crc-fast's aarch64 path uses the CRC instructions but chooses itself by the AES feature alone: an
    // ARMv8.0 core with AES and without CRC gets the crate (which checks for CRC)
    #[cfg(target_arch = "aarch64")]
    if !std::arch::is_aarch64_feature_detected!("crc") {
        return crc32c::crc32c(bytes);
    }
    // CRC-32/ISCSI is crc32c; the 32-bit result is returned in a u64
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// The length of the pieces a large object is read and summed in: the store reads an object over
/// [`PIECE`] bytes as pieces on several IO workers, each summing its piece as soon as it has read it, so
/// the sums run beside the other reads instead of after the last one (docs/STORE.md, "get").
pub const PIECE: usize = 1 << 20;

/// crc32c of one piece of an object's bytes; [`object_crc_of_pieces`] joins them. Zero, without reading
/// the bytes, in the build [`object_crc`] is zero in.
#[inline]
pub fn piece_crc(bytes: &[u8]) -> u32 {
    #[cfg(kvtier_bench_unverified)]
    {
        let _ = bytes;
        0
    }
    #[cfg(not(kvtier_bench_unverified))]
    {
        bulk_crc(bytes)
    }
}

/// [`object_crc`] of the bytes whose consecutive pieces had [`piece_crc`]s `pieces[i].0` and lengths
/// `pieces[i].1` (in order, together the whole object).
pub fn object_crc_of_pieces(pieces: &[(u32, usize)], key: &str) -> u32 {
    #[cfg(kvtier_bench_unverified)]
    {
        let _ = (pieces, key);
        0
    }
    #[cfg(not(kvtier_bench_unverified))]
    {
        // crc32c(x ‖ y) = shift(crc32c(x), |y|) ^ crc32c(y), as crc32c_combine computes it
        let crc = pieces
            .iter()
            .fold(0, |crc, &(c, len)| shift_zeros(crc, len) ^ c);
        crc32c::crc32c_append(crc, key.as_bytes())
    }
}

/// `crc32c_combine(crc, 0, len)` (the checksum as if `len` zero bytes followed) in at most one 32-term
/// product per set bit of `len`: the operators for 2^k bytes are built once, the first from
/// crc32c_combine of the unit vectors, each next one as the square of the one before (crc32c_combine
/// itself squares its way up on every call: ~10 µs, which once per object of a batch is milliseconds).
#[cfg(not(kvtier_bench_unverified))]
fn shift_zeros(crc: u32, len: usize) -> u32 {
    type Op = [u32; 32];
    fn times(op: &Op, v: u32) -> u32 {
        (0..32)
            .filter(|i| v >> i & 1 == 1)
            .fold(0, |acc, i| acc ^ op[i])
    }
    static OPS: std::sync::OnceLock<Vec<Op>> = std::sync::OnceLock::new();
    let ops = OPS.get_or_init(|| {
        let mut ops: Vec<Op> = vec![std::array::from_fn(|i| {
            crc32c::crc32c_combine(1 << i, 0, 1)
        })];
        for _ in 1..usize::BITS {
            let last = *ops.last().expect("one");
            ops.push(std::array::from_fn(|i| times(&last, last[i])));
        }
        ops
    });
    (0..usize::BITS as usize)
        .filter(|k| len >> k & 1 == 1)
        .fold(crc, |c, k| times(&ops[k], c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shift_operators_agree_with_crc32c_combine() {
        for len in [
            0usize,
            1,
            2,
            3,
            255,
            4096,
            12_345,
            PIECE,
            PIECE + 1,
            123_456_789,
            1 << 40,
        ] {
            for (a, b) in [
                (0u32, 0u32),
                (0xDEAD_BEEF, 0),
                (0xDEAD_BEEF, 0x1234_5678),
                (u32::MAX, 1),
            ] {
                if len == 0 && b != 0 {
                    continue; // (no bytes have a crc of 0; crc32c_combine then ignores its crc2)
                }
                assert_eq!(
                    shift_zeros(a, len) ^ b,
                    crc32c::crc32c_combine(a, b, len),
                    "{len}"
                );
            }
        }
    }

    /// `len` bytes of xorshift64 from `seed` (no run of them repeats).
    fn noise(mut x: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Pieces of any lengths, full pieces among them, join to the object's checksum; a changed byte or
    /// key, or pieces out of order, do not.
    #[test]
    fn pieces_join_to_the_object_crc() {
        let bytes = noise(0x9E37_79B9_7F4A_7C15, 3 * PIECE + 12_345);
        let cuts: &[&[usize]] = &[
            &[],
            &[PIECE, 2 * PIECE, 3 * PIECE],
            &[4096, 4096 + PIECE, 4096 + 2 * PIECE],
            &[1, 7, PIECE + 7, 3 * PIECE + 12_000],
        ];
        for cut in cuts {
            let mut at = 0;
            let mut pieces = Vec::new();
            for &c in cut.iter().chain(std::iter::once(&bytes.len())) {
                pieces.push((piece_crc(&bytes[at..c]), c - at));
                at = c;
            }
            assert_eq!(
                object_crc_of_pieces(&pieces, "k"),
                object_crc(&bytes, "k"),
                "cut {cut:?}"
            );
            assert_ne!(object_crc_of_pieces(&pieces, "j"), object_crc(&bytes, "k"));
            if pieces.len() > 1 {
                let mut swapped = pieces.clone();
                swapped.swap(0, 1);
                if swapped[0].1 == swapped[1].1 {
                    assert_ne!(object_crc_of_pieces(&swapped, "k"), object_crc(&bytes, "k"));
                }
            }
        }
        let mut other = bytes.clone();
        other[2 * PIECE + 3] ^= 1;
        let pieces: Vec<(u32, usize)> = other
            .chunks(PIECE)
            .map(|c| (piece_crc(c), c.len()))
            .collect();
        assert_ne!(object_crc_of_pieces(&pieces, "k"), object_crc(&bytes, "k"));
        assert_eq!(object_crc_of_pieces(&[], "k"), object_crc(&[], "k"));
    }

    /// The fast checksum is crc32c to the bit: against the `crc32c` crate at every length up to 600 bytes
    /// from every start offset within a vector register, at the piece sizes, on non-repeating bytes; and
    /// the catalogue's check value ("123456789" -> 0xE3069283). Journals and records on disk depend on it.
    #[cfg(not(kvtier_bench_unverified))]
    #[test]
    fn the_fast_checksum_is_crc32c() {
        let bytes = noise(0x2545_F491_4F6C_DD1D, 2 * PIECE + 4096);
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        assert_eq!(bulk_crc(b"123456789"), 0xE306_9283);
        for start in 0..64 {
            for len in 0..600 {
                let b = &bytes[start..start + len];
                assert_eq!(bulk_crc(b), crc32c::crc32c(b), "start {start}, len {len}");
            }
        }
        // 3,000 more lengths to 40 KiB at any start (the vector loops' tails and their folds at every size)
        for _ in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let (start, len) = ((x % 4096) as usize, (x >> 32) as usize % 40_960);
            let b = &bytes[start..start + len];
            assert_eq!(bulk_crc(b), crc32c::crc32c(b), "start {start}, len {len}");
        }
        for len in [
            4095,
            4096,
            65_536,
            PIECE - 1,
            PIECE,
            PIECE + 1,
            2 * PIECE + 4000,
        ] {
            let b = &bytes[3..3 + len];
            assert_eq!(bulk_crc(b), crc32c::crc32c(b), "len {len}");
            assert_eq!(piece_crc(b), crc32c::crc32c(b));
            assert_eq!(
                object_crc(b, "key"),
                crc32c::crc32c_append(crc32c::crc32c(b), b"key")
            );
        }
    }

    #[test]
    fn known_vectors() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let h = page_hashes(&[1, 2, 3, 4, 5], 2, None).unwrap();
        assert_eq!(h.len(), 3); // two full pages and the partial one
        let mut first = Vec::new();
        for t in [1u32, 2] {
            first.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(h[0], sha256_hex(&first));
        let mut second = unhex(&h[0]).unwrap();
        for t in [3u32, 4] {
            second.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(h[1], sha256_hex(&second));
        assert_eq!(page_hashes(&[3, 4], 2, Some(&h[0])).unwrap()[0], h[1]);
        assert!(page_hashes(&[1], 0, None).is_err());
        assert!(page_hashes(&[1], 1, Some("xyz")).is_err());
    }
}

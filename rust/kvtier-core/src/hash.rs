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
    if b.len() % 2 != 0 {
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
        crc32c::crc32c_append(crc32c::crc32c(bytes), key.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! The hasher of the index's maps and of replay's: a multiply-and-fold hash, several times faster than
//! std's SipHash on the store's keys (64 hex characters and a suffix), which replay hashes once or twice
//! per journal record and the index once per live key at open.
//!
//! It is not a keyed PRF like SipHash, so it does not claim SipHash's resistance to chosen collisions
//! (HashDoS), and the store does not need it: its keys are written by the store's own callers and are
//! hashes already (the connectors' page hashes chained over the tokens, a tenant's keys a MAC under the
//! tenant's key, docs/SECURITY.md), so a client choosing prompts does not choose their bits; and a caller
//! that can choose keys can already fill the store. The start state is drawn once per process (as std's
//! maps draw theirs), so no colliding key set works against every process. A key set that did collide
//! would only slow the maps down: they stay correct whatever the hashes.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::OnceLock;

/// A `HashMap` with [`FastHasher`].
pub(in crate::store) type FastMap<K, V> = HashMap<K, V, FastBuild>;

/// Builds [`FastHasher`]s, all of a map with the same start state, drawn once per process.
#[derive(Clone, Copy, Debug)]
pub(in crate::store) struct FastBuild(u64);

impl Default for FastBuild {
    fn default() -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        // std's per-process random keys, taken once (a map is built per open and per batch, not per key)
        FastBuild(*SEED.get_or_init(|| RandomState::new().hash_one(START)))
    }
}

impl BuildHasher for FastBuild {
    type Hasher = FastHasher;

    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher(self.0)
    }
}

/// Each 8 bytes of input are xored into the state, which is then multiplied by an odd constant as a
/// 128-bit product whose halves are folded together, so every bit of the input reaches every bit of the
/// state (hashbrown takes the bucket from the low bits and the tag from the top 7).
pub(in crate::store) struct FastHasher(u64);

/// Hashed with std's random keys into the start state (the fractional digits of pi).
const START: u64 = 0x243f_6a88_85a3_08d3;
/// The multiplier: odd, about half its bits set (2^64 / the golden ratio).
const MUL: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline]
fn fold(state: u64, word: u64) -> u64 {
    let p = u128::from(state ^ word) * u128::from(MUL);
    (p as u64) ^ ((p >> 64) as u64)
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            h = fold(h, u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            // the length tells `ab` from `ab\0` (`str` also writes a 0xff after its bytes)
            h = fold(h, u64::from_le_bytes(last) ^ ((rest.len() as u64) << 59));
        }
        self.0 = h;
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.0 = fold(self.0, u64::from(n));
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.0 = fold(self.0, u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = fold(self.0, n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.0 = fold(self.0, n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn hash<T: std::hash::Hash + ?Sized>(x: &T) -> u64 {
        FastBuild::default().hash_one(x)
    }

    #[test]
    fn store_keys_spread_over_buckets_and_tags() {
        // a million page keys as the connectors write them: 64 hex characters of a hash and a suffix
        let n = 1u64 << 20;
        let mut low = vec![0u32; 1 << 16];
        let mut tags = [0u32; 128];
        let mut seen = HashSet::new();
        for i in 0..n {
            let key = format!(
                "{:064x}.{}",
                i.wrapping_mul(0x2545_f491_4f6c_dd1d),
                ["k", "v"][i as usize % 2]
            );
            let h = hash(key.as_str());
            assert!(seen.insert(h), "64-bit collision at {i}");
            low[(h & 0xffff) as usize] += 1;
            tags[(h >> 57) as usize] += 1;
        }
        // each of 65,536 low buckets expects 16 keys, each of 128 tags 8,192: no bucket far from it
        let (lo, hi) = (low.iter().min().unwrap(), low.iter().max().unwrap());
        assert!(
            *lo >= 1 && *hi <= 48,
            "low bits: {lo}..{hi} keys per bucket"
        );
        let (lo, hi) = (tags.iter().min().unwrap(), tags.iter().max().unwrap());
        assert!(
            *lo >= 7_500 && *hi <= 8_900,
            "tags: {lo}..{hi} keys per tag"
        );
    }

    #[test]
    fn short_keys_and_numbers_differ() {
        let keys = [
            "",
            "a",
            "b",
            "ab",
            "ba",
            "a\0",
            "\0",
            "\0\0",
            "abcdefgh",
            "abcdefgh\0",
        ];
        let hs: HashSet<u64> = keys.iter().map(|k| hash(*k)).collect();
        assert_eq!(hs.len(), keys.len());
        let ns: HashSet<u64> = (0u32..100_000).map(|n| hash(&n)).collect();
        assert_eq!(ns.len(), 100_000);
        let classes: HashSet<u64> = (1u32..=4096).map(|c| hash(&(c * 4096)) & 0xfff).collect();
        assert!(
            classes.len() > 2_000,
            "size classes in 4,096 buckets: {}",
            classes.len()
        );
    }
}

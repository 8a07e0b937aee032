//! Replay's key interning: which journal records name the same key, found by sorting the records'
//! hashes instead of looking each key up in a hash map.
//!
//! A map of a million keys is far larger than the caches, so each of the journal's records cost replay a
//! few cache misses there (its look-up was most of replay's time). Here each key is hashed once, in
//! journal order; the hashes, each with its record's place, are sorted; records of one key are then
//! neighbours, and their keys are compared byte for byte, so two keys whose hashes agree are never taken
//! for one.

use std::hash::BuildHasher;

use crate::store::index::fasthash::FastBuild;

/// For each of `n` records (`key(i)`: the bytes of the key record `i` names), the place of the first record that
/// names the same key: the key's id, the same for every record of the key and distinct between keys.
/// `None` when there are 2^32 records or more (a journal of over 128 GiB, which replay refuses).
pub(in crate::store) fn first_of_key<'a>(
    n: usize,
    key: impl Fn(usize) -> &'a [u8],
) -> Option<Vec<u32>> {
    let hasher = FastBuild::default();
    first_of_key_by(n, key, |k| hasher.hash_one(k))
}

/// [`first_of_key`] with the hash given (tests give one that collides).
pub(in crate::store) fn first_of_key_by<'a>(
    n: usize,
    key: impl Fn(usize) -> &'a [u8],
    hash: impl Fn(&[u8]) -> u64,
) -> Option<Vec<u32>> {
    const PLACE: u64 = 0xffff_ffff;
    u32::try_from(n).ok()?;
    // the hash's top 32 bits above the record's place: sorted, a key's records are one run, in order
    let mut v: Vec<u64> = (0..n).map(|i| (hash(key(i)) & !PLACE) | i as u64).collect();
    v.sort_unstable();
    let place = |x: u64| (x & PLACE) as usize;
    let key = |x: u64| key(place(x));
    let mut first = vec![0u32; n];
    let mut a = 0;
    while a < v.len() {
        let top = v[a] >> 32;
        let b = a + v[a..].iter().take_while(|&&x| x >> 32 == top).count();
        let run = &mut v[a..b];
        if run.len() == 1 {
            // a key of one record (most of them): its record is not read
            first[place(run[0])] = place(run[0]) as u32;
        } else if run[1..].iter().all(|&x| key(x) == key(run[0])) {
            // one key (nearly always): its first record is the run's first
            for &x in run.iter() {
                first[place(x)] = place(run[0]) as u32;
            }
        } else {
            // keys whose hashes share these bits: by key, then by place; each key's first is its least
            run.sort_unstable_by(|&x, &y| key(x).cmp(key(y)).then(place(x).cmp(&place(y))));
            let mut g = 0;
            for j in 0..run.len() {
                if key(run[j]) != key(run[g]) {
                    g = j;
                }
                first[place(run[j])] = place(run[g]) as u32;
            }
        }
        a = b;
    }
    Some(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// What a map gives: each record's key's first place.
    fn by_map(keys: &[String]) -> Vec<u32> {
        let mut seen: HashMap<&str, u32> = HashMap::new();
        (0..keys.len() as u32)
            .map(|i| *seen.entry(keys[i as usize].as_str()).or_insert(i))
            .collect()
    }

    fn first(keys: &[String], hash: impl Fn(&[u8]) -> u64) -> Vec<u32> {
        first_of_key_by(keys.len(), |i| keys[i].as_bytes(), hash).unwrap()
    }

    proptest! {
        /// Whatever the hash — the store's, one where many keys collide, one where all do — each record
        /// gets its key's first place, as a map finds it.
        #[test]
        fn every_record_gets_its_keys_first_place(keys in proptest::collection::vec("[a-c]{0,3}", 0..200)) {
            let want = by_map(&keys);
            prop_assert_eq!(first_of_key(keys.len(), |i| keys[i].as_bytes()).unwrap(), want.clone());
            // only the length: keys of one length collide in all 64 bits, and in the top 32
            prop_assert_eq!(first(&keys, |k| (k.len() as u64) << 40), want.clone());
            prop_assert_eq!(first(&keys, |_| 7), want);
        }
    }

    #[test]
    fn page_keys_of_a_journal() {
        // K and V of 50,000 pages put, every third deleted, a tenth put again (the keys of those records)
        let mut keys = Vec::new();
        for p in 0..50_000u64 {
            let h = format!("{:064x}", p.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            keys.push(format!("{h}.k"));
            keys.push(format!("{h}.v"));
        }
        let puts_n = keys.len();
        for i in (0..puts_n).step_by(3) {
            keys.push(keys[i].clone());
        }
        for i in (0..puts_n).step_by(10) {
            keys.push(keys[i].clone());
        }
        let got = first_of_key(keys.len(), |i| keys[i].as_bytes()).unwrap();
        assert_eq!(got, by_map(&keys));
    }
}

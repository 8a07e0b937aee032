//! Replay's key interning: which journal records name the same key, found by sorting the records'
//! hashes instead of looking each key up in a hash map.
//!
//! A map of a million keys is far larger than the caches, so each of the journal's records cost replay a
//! few cache misses there (its look-up was most of replay's time). Here each key is hashed once, in
//! journal order; the hashes, each with its record's place, are sorted; records of one key are then
//! neighbours, and their keys are compared byte for byte, so two keys whose hashes agree are never taken
//! for one.

use std::hash::BuildHasher;

use super::fasthash::FastBuild;
use super::journal::RecordRef as Record;

/// The key a record names.
pub(super) fn key_of<'a>(r: &Record<'a>) -> &'a str {
    match *r {
        Record::Put { key, .. } | Record::Del { key } => key,
    }
}

/// For each record, the place of the first record that names the same key: the key's id, the same for
/// every record of the key and distinct between keys. `None` when there are 2^32 records or more (a
/// journal of over 128 GiB, which replay refuses).
pub(super) fn first_of_key(records: &[Record<'_>]) -> Option<Vec<u32>> {
    let hasher = FastBuild::default();
    first_of_key_by(records, |k| hasher.hash_one(k))
}

/// [`first_of_key`] with the hash given (tests give one that collides).
pub(super) fn first_of_key_by(
    records: &[Record<'_>],
    hash: impl Fn(&str) -> u64,
) -> Option<Vec<u32>> {
    const PLACE: u64 = 0xffff_ffff;
    u32::try_from(records.len()).ok()?;
    // the hash's top 32 bits above the record's place: sorted, a key's records are one run, in order
    let mut v: Vec<u64> = records
        .iter()
        .enumerate()
        .map(|(i, r)| (hash(key_of(r)) & !PLACE) | i as u64)
        .collect();
    v.sort_unstable();
    let place = |x: u64| (x & PLACE) as usize;
    let key = |x: u64| key_of(&records[place(x)]);
    let mut first = vec![0u32; records.len()];
    let mut a = 0;
    while a < v.len() {
        let top = v[a] >> 32;
        let b = a + v[a..].iter().take_while(|&&x| x >> 32 == top).count();
        let run = &mut v[a..b];
        let k0 = key(run[0]);
        if run[1..].iter().all(|&x| key(x) == k0) {
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
    use crate::store::journal::Placement;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// What a map gives: each record's key's first place.
    fn by_map(records: &[Record<'_>]) -> Vec<u32> {
        let mut seen: HashMap<&str, u32> = HashMap::new();
        (0..records.len() as u32)
            .map(|i| *seen.entry(key_of(&records[i as usize])).or_insert(i))
            .collect()
    }

    fn records(keys: &[String], puts: &[bool]) -> Vec<Record<'static>> {
        keys.iter()
            .zip(puts)
            .map(|(k, &p)| {
                let key: &'static str = Box::leak(k.clone().into_boxed_str());
                if p {
                    Record::Put {
                        key,
                        at: Placement {
                            class: 4096,
                            slot: 0,
                            len: 1,
                            crc: 0,
                            seal: None,
                        },
                    }
                } else {
                    Record::Del { key }
                }
            })
            .collect()
    }

    proptest! {
        /// Whatever the hash — the store's, one where many keys collide, one where all do — each record
        /// gets its key's first place, as a map finds it.
        #[test]
        fn every_record_gets_its_keys_first_place(
            keys in proptest::collection::vec("[a-c]{0,3}", 0..200),
            puts in proptest::collection::vec(any::<bool>(), 200),
        ) {
            let recs = records(&keys, &puts);
            let want = by_map(&recs);
            prop_assert_eq!(first_of_key(&recs).unwrap(), want.clone());
            // only the length: keys of one length collide in all 64 bits, and in the top 32
            let by_len = first_of_key_by(&recs, |k| (k.len() as u64) << 40).unwrap();
            prop_assert_eq!(by_len, want.clone());
            prop_assert_eq!(first_of_key_by(&recs, |_| 7).unwrap(), want);
        }
    }

    #[test]
    fn page_keys_of_a_journal() {
        // K and V of 50,000 pages put, every third deleted, a tenth put again
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
        let puts: Vec<bool> = (0..keys.len())
            .map(|i| i < puts_n || i >= puts_n + puts_n.div_ceil(3))
            .collect();
        let recs = records(&keys, &puts);
        assert_eq!(first_of_key(&recs).unwrap(), by_map(&recs));
    }
}

//! The page store's journal: an append-only log of `put` and `del` records, each checksummed.
//!
//! Record layout (little-endian):
//!
//! ```text
//! magic u32 = 0x4b56544a ("KVTJ") | kind u8 (1 put, 2 del) | key_len u16 | class u32 | slot u32 |
//! len u64 | crc u32 (crc32c of the object's bytes, then its key) | key [key_len] | record_crc u32
//! ```
//!
//! `record_crc` covers every byte before it. Recovery reads records in order and stops at the first one that
//! is incomplete or fails its checks: a torn tail from a crash is cut off, never interpreted.
//! [`parse`] never panics, whatever the bytes (a property test feeds it random input).

/// Record magic.
pub const MAGIC: u32 = 0x4b56_544a;
const FIXED: usize = 4 + 1 + 2 + 4 + 4 + 8 + 4;
/// Longest key accepted (HiCache keys are 64 hex characters plus a suffix).
pub const MAX_KEY: usize = 1024;

/// A journal record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// `key` now lives in slot `slot` of size class `class`, `len` bytes with checksum `crc`.
    Put {
        /// Object key.
        key: String,
        /// Size class (slot size in bytes).
        class: u32,
        /// Slot index in that class's data file.
        slot: u32,
        /// Object length in bytes.
        len: u64,
        /// crc32c of the object bytes followed by the key bytes.
        crc: u32,
    },
    /// `key` is gone.
    Del {
        /// Object key.
        key: String,
    },
}

impl Record {
    /// Appends the encoded record to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let (kind, key, class, slot, len, crc) = match self {
            Record::Put {
                key,
                class,
                slot,
                len,
                crc,
            } => (1u8, key, *class, *slot, *len, *crc),
            Record::Del { key } => (2u8, key, 0, 0, 0, 0),
        };
        debug_assert!(key.len() <= MAX_KEY);
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.push(kind);
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
        out.extend_from_slice(&class.to_le_bytes());
        out.extend_from_slice(&slot.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(key.as_bytes());
        let rc = crc32c::crc32c(&out[start..]);
        out.extend_from_slice(&rc.to_le_bytes());
    }
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Parses records from the start of `buf`; returns them and the length of the valid prefix (where a torn
/// or corrupt tail begins).
pub fn parse(buf: &[u8]) -> (Vec<Record>, usize) {
    let mut out = Vec::new();
    let mut off = 0;
    while let Some((rec, n)) = parse_one(&buf[off..]) {
        out.push(rec);
        off += n;
    }
    (out, off)
}

fn parse_one(b: &[u8]) -> Option<(Record, usize)> {
    if b.len() < FIXED + 4 || u32_at(b, 0) != MAGIC {
        return None;
    }
    let kind = b[4];
    let key_len = u16_at(b, 5) as usize;
    if key_len > MAX_KEY {
        return None;
    }
    let total = FIXED + key_len + 4;
    if b.len() < total {
        return None;
    }
    if crc32c::crc32c(&b[..FIXED + key_len]) != u32_at(b, FIXED + key_len) {
        return None;
    }
    let key = std::str::from_utf8(&b[FIXED..FIXED + key_len])
        .ok()?
        .to_owned();
    let rec = match kind {
        1 => Record::Put {
            key,
            class: u32_at(b, 7),
            slot: u32_at(b, 11),
            len: u64_at(b, 15),
            crc: u32_at(b, 23),
        },
        2 => Record::Del { key },
        _ => return None,
    };
    Some((rec, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_torn_tail() {
        let recs = vec![
            Record::Put {
                key: "a".repeat(64),
                class: 8192,
                slot: 3,
                len: 5000,
                crc: 77,
            },
            Record::Del { key: "b".into() },
            Record::Put {
                key: "../../etc/x".into(),
                class: 4096,
                slot: 0,
                len: 1,
                crc: 1,
            },
        ];
        let mut buf = Vec::new();
        for r in &recs {
            r.encode(&mut buf);
        }
        let (got, n) = parse(&buf);
        assert_eq!(got, recs);
        assert_eq!(n, buf.len());
        for cut in 0..buf.len() {
            let (got, n) = parse(&buf[..cut]);
            assert!(n <= cut);
            assert_eq!(got[..], recs[..got.len()]);
        }
        let mut bad = buf.clone();
        let last = bad.len() - 6;
        bad[last] ^= 0xff;
        assert_eq!(parse(&bad).0.len(), 2);
    }

    proptest! {
        #[test]
        fn parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let (recs, n) = parse(&bytes);
            prop_assert!(n <= bytes.len());
            prop_assert!(recs.len() <= bytes.len() / (FIXED + 4) + 1);
        }

        #[test]
        fn mutated_journal_yields_a_prefix(seed_keys in proptest::collection::vec("[a-f0-9]{1,70}", 1..6),
                                           flip in any::<usize>()) {
            let recs: Vec<Record> = seed_keys.iter().enumerate().map(|(i, k)| Record::Put {
                key: k.clone(), class: 4096, slot: i as u32, len: 10, crc: i as u32 }).collect();
            let mut buf = Vec::new();
            for r in &recs { r.encode(&mut buf); }
            let i = flip % buf.len();
            buf[i] ^= 0x5a;
            let (got, _) = parse(&buf);
            // a flipped byte can only shorten the valid prefix, never change a record
            prop_assert!(got.len() < recs.len());
            prop_assert_eq!(&got[..], &recs[..got.len()]);
        }
    }
}

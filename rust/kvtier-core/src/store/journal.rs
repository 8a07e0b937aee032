//! The page store's journal: an append-only log of `put` and `del` records, each checksummed.
//!
//! Record layout: [`layout`], its one definition (magic, kind, key_len, class, slot, len, crc, then the
//! optional parts a put's kind says it carries — a coded put's decoded_len, a sealed put's seal — the key
//! and record_crc; little-endian).
//!
//! A sealed put is the put of an object encrypted at rest (`crate::seal`): its seal is the nonce and
//! authentication tag, and `crc` covers the stored (encrypted) bytes. A coded put is the put of an object
//! stored compressed (`crate::codec`): `len` and `crc` are the stored bytes', `decoded_len` the length it
//! decodes to (what a reader asks for); a coded sealed put was compressed, then sealed.
//!
//! `record_crc` covers every byte before it. [`parse`] reads records in order; where one fails its checks it
//! resynchronises on the next offset where a whole record parses, reporting the bytes in between as a
//! damaged span, so one damaged record costs that record only. Bytes after the last valid record are a torn
//! tail (a crash during an append). [`parse`] never panics, whatever the bytes (property tests feed it
//! random input). See docs/STORE.md.

pub mod layout;

use crate::seal::{Seal, SEAL_LEN};
pub use layout::PutParts;
use layout::FIXED;

/// The on-disk format this kvtier writes and reads: the journal records below, data files, namespace files and
/// the root's `BUDGET` table described in docs/STORE.md. A change to a record's layout bumps it, so a kvtier
/// that reads another format refuses the store by name at open (`format::check`) instead of reading its
/// records as damage.
///
/// Format 2 added the coded puts (kinds 4 and 5); a format-1 store opens and reads as it is, and its first
/// writable open moves its `FORMAT` files to 2 (an older kvtier then refuses it by name instead of
/// skipping the coded records as damage).
pub const FORMAT_VERSION: u32 = 2;
/// The older formats this kvtier reads (and moves to [`FORMAT_VERSION`] when it opens one writable).
pub const FORMATS_READ: &[u32] = &[1];
/// Record magic.
pub const MAGIC: u32 = 0x4b56_544a;
/// Longest key accepted (HiCache keys are 64 hex characters plus a suffix).
pub const MAX_KEY: usize = 1024;

/// Where a put record says an object lives and how to check it: every field of a put but its key. Replay,
/// followers and the index take it whole, so a field added here reaches them without a change there. Made
/// with [`Placement::new`] and the `with_` methods (an optional field added later is `None` there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Size class (slot size in bytes).
    pub class: u32,
    /// Slot index in that class's data file.
    pub slot: u32,
    /// Object length in bytes.
    pub len: u64,
    /// crc32c of the object bytes followed by the key bytes.
    pub crc: u32,
    /// Nonce and tag of an object sealed at rest; `None`: stored in clear.
    pub seal: Option<Seal>,
    /// `Some(length it decodes to)` for an object stored compressed (`crate::codec`; `len` is then the
    /// stored length); `None`: stored as given.
    pub coded: Option<u64>,
}

/// A journal record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// `key` now lives where `at` says.
    Put {
        /// Object key.
        key: String,
        /// Its slot, length, checksum and seal.
        at: Placement,
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
        match self {
            Record::Put { key, at } => encode_put(out, key, at),
            Record::Del { key } => encode_raw(out, layout::DEL, key, &Placement::default()),
        }
    }
}

impl Default for Placement {
    /// The all-zero fields a del record carries.
    fn default() -> Self {
        Placement {
            class: 0,
            slot: 0,
            len: 0,
            crc: 0,
            seal: None,
            coded: None,
        }
    }
}

impl Placement {
    /// An object of `len` bytes in `slot` of size class `class`, its crc `crc`, stored in clear and as given
    /// (no optional part: the `with_` methods add them).
    pub fn new(class: u32, slot: u32, len: u64, crc: u32) -> Self {
        Placement {
            class,
            slot,
            len,
            crc,
            ..Placement::default()
        }
    }
    /// This placement with `seal` (`None`: stored in clear).
    pub fn with_seal(self, seal: Option<Seal>) -> Self {
        Placement { seal, ..self }
    }
    /// This placement with `coded` (`Some(length it decodes to)`: stored compressed).
    pub fn with_coded(self, coded: Option<u64>) -> Self {
        Placement { coded, ..self }
    }
}

impl PutParts {
    /// The optional parts the put record of `at` carries: one line per optional field of [`Placement`].
    pub fn of(at: &Placement) -> PutParts {
        PutParts::NONE
            .with(PutParts::CODED, at.coded.is_some())
            .with(PutParts::SEALED, at.seal.is_some())
    }
}

/// Appends the encoded put record of `key` to `out` (as `Record::Put`'s `encode`, without a `Record`).
pub fn encode_put(out: &mut Vec<u8>, key: &str, at: &Placement) {
    encode_raw(out, layout::put_kind(PutParts::of(at)), key, at)
}

/// Bytes of a put record of a `key_len`-byte key carrying `parts` once encoded (the longest:
/// [`PutParts::ALL`] and [`MAX_KEY`]).
pub const fn put_len(key_len: usize, parts: PutParts) -> usize {
    parts.record_len(key_len)
}

fn encode_raw(out: &mut Vec<u8>, kind: u8, key: &str, at: &Placement) {
    let start = out.len();
    debug_assert!(key.len() <= MAX_KEY);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(&at.class.to_le_bytes());
    out.extend_from_slice(&at.slot.to_le_bytes());
    out.extend_from_slice(&at.len.to_le_bytes());
    out.extend_from_slice(&at.crc.to_le_bytes());
    debug_assert_eq!(out.len() - start, FIXED);
    // each optional part at its place ([`layout::PARTS`]); a del carries none
    let parts = layout::parts_of(kind).unwrap_or(PutParts::NONE);
    out.resize(start + parts.key_at(), 0);
    let mut part = |p: PutParts, bytes: &[u8]| {
        debug_assert!(
            parts.has(p)
                && layout::PARTS
                    .iter()
                    .any(|x| x.bit == p && x.len == bytes.len())
        );
        let o = start + parts.at(p);
        out[o..o + bytes.len()].copy_from_slice(bytes);
    };
    if let Some(c) = at.coded {
        part(PutParts::CODED, &c.to_le_bytes());
    }
    if let Some(s) = &at.seal {
        part(PutParts::SEALED, s);
    }
    debug_assert_eq!(out.len() - start, layout::key_at(kind));
    out.extend_from_slice(key.as_bytes());
    let rc = crc32c::crc32c(&out[start..]);
    out.extend_from_slice(&rc.to_le_bytes());
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

/// A record read in place: its key borrowed from the journal's bytes (replay at open takes these, so that
/// no record allocates; only the keys live at the end are copied, once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordRef<'a> {
    /// `key` now lives where `at` says.
    Put {
        /// Object key.
        key: &'a str,
        /// Its slot, length, checksum and seal.
        at: Placement,
    },
    /// `key` is gone.
    Del {
        /// Object key.
        key: &'a str,
    },
}

impl<'a> RecordRef<'a> {
    /// The key the record names.
    pub fn key(&self) -> &'a str {
        match *self {
            RecordRef::Put { key, .. } | RecordRef::Del { key } => key,
        }
    }

    /// The record with its key copied.
    pub fn to_record(self) -> Record {
        match self {
            RecordRef::Put { key, at } => Record::Put {
                key: key.to_owned(),
                at,
            },
            RecordRef::Del { key } => Record::Del {
                key: key.to_owned(),
            },
        }
    }
}

/// What [`parse`] found in a journal (records owned: [`Record`]; read in place: [`RecordRef`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed<R = Record> {
    /// Valid records, in file order.
    pub records: Vec<R>,
    /// `(offset, length)` of each damaged span: bytes between valid records that form no record.
    pub damaged: Vec<(usize, usize)>,
    /// End of the last valid record: bytes from here on are a torn tail.
    pub valid_end: usize,
}

impl<R> Parsed<R> {
    /// Bytes in damaged spans.
    pub fn damaged_bytes(&self) -> usize {
        self.damaged.iter().map(|d| d.1).sum()
    }
}

/// Parses a whole journal with resynchronisation (see the module docs).
pub fn parse_resync(buf: &[u8]) -> Parsed {
    let p = parse_resync_in_place(buf);
    Parsed {
        records: p.records.into_iter().map(RecordRef::to_record).collect(),
        damaged: p.damaged,
        valid_end: p.valid_end,
    }
}

/// [`parse_resync`] with each record's key borrowed from `buf`.
pub fn parse_resync_in_place(buf: &[u8]) -> Parsed<RecordRef<'_>> {
    parse_resync_with(buf, |rec, _| rec)
}

/// The record at `off` in `buf`, an offset [`parse_resync_with`] gave for this very `buf` (its checksum
/// is not computed again). Panics where no record of a valid shape starts at `off`.
pub(crate) fn record_at(buf: &[u8], off: usize) -> RecordRef<'_> {
    decode(&buf[off..], false)
        .expect("an offset the parser gave for these bytes")
        .0
}

/// The key bytes of the record at `off` in `buf`, an offset [`parse_resync_with`] gave for this `buf`.
pub(crate) fn key_bytes_at(buf: &[u8], off: usize) -> &[u8] {
    let b = &buf[off..];
    let head = layout::key_at(b[layout::KIND.at]);
    &b[head..head + u16_at(b, layout::KEY_LEN.at) as usize]
}

/// The resynchronising parse (see the module docs), keeping of each valid record what `keep` makes of it
/// and its offset: replay at open keeps a few fields and the offset, a sixth of a [`RecordRef`], and
/// reads the rest at the offset ([`record_at`], [`key_bytes_at`]) where it needs it.
pub(crate) fn parse_resync_with<'a, R>(
    buf: &'a [u8],
    keep: impl Fn(RecordRef<'a>, usize) -> R,
) -> Parsed<R> {
    let mut out = Parsed {
        records: Vec::new(),
        damaged: Vec::new(),
        valid_end: 0,
    };
    let mut off = 0;
    while off < buf.len() {
        if let Some((rec, n)) = parse_one(&buf[off..]) {
            out.records.push(keep(rec, off));
            off += n;
            out.valid_end = off;
            continue;
        }
        // search forward for the next whole record; none means the rest is a torn tail
        let next = (off + 1..buf.len().saturating_sub(FIXED + layout::RECORD_CRC_LEN - 1))
            .find(|&o| u32_at(buf, o) == MAGIC && parse_one(&buf[o..]).is_some());
        match next {
            Some(o) => {
                out.damaged.push((off, o - off));
                off = o;
            }
            None => break,
        }
    }
    out
}

/// Parses the valid prefix of `buf`: the records before the first one that fails its checks, and the
/// prefix's length. (Recovery uses [`parse_resync`]; this is the strict reading.)
pub fn parse(buf: &[u8]) -> (Vec<Record>, usize) {
    let mut out = Vec::new();
    let mut off = 0;
    while let Some((rec, n)) = parse_one(&buf[off..]) {
        out.push(rec.to_record());
        off += n;
    }
    (out, off)
}

/// Whether a put record's shape is one the store writes: a size class that is a positive multiple of 4096
/// and a length within it (replay also checks the slot against the data file; a follower cannot).
pub(super) fn put_shape_ok(class: u32, len: u64) -> bool {
    class > 0 && u64::from(class) % 4096 == 0 && len > 0 && len <= u64::from(class)
}

/// Bytes of a del or clear put record of a `key_len`-byte key once encoded (a put carrying optional
/// parts: [`put_len`]).
pub const fn encoded_len(key_len: usize) -> usize {
    layout::record_len(layout::DEL, key_len)
}

fn parse_one(b: &[u8]) -> Option<(RecordRef<'_>, usize)> {
    decode(b, true)
}

/// The record at the start of `b` and its length, if one of a valid shape starts there; with `check`,
/// only if its checksum matches too.
fn decode(b: &[u8], check: bool) -> Option<(RecordRef<'_>, usize)> {
    if b.len() < FIXED + layout::RECORD_CRC_LEN || u32_at(b, layout::MAGIC_FIELD.at) != MAGIC {
        return None;
    }
    let kind = b[layout::KIND.at];
    let key_len = u16_at(b, layout::KEY_LEN.at) as usize;
    if key_len > MAX_KEY {
        return None;
    }
    let head = layout::key_at(kind);
    let total = head + key_len + layout::RECORD_CRC_LEN;
    if b.len() < total {
        return None;
    }
    if check && crc32c::crc32c(&b[..head + key_len]) != u32_at(b, head + key_len) {
        return None;
    }
    let key = std::str::from_utf8(&b[head..head + key_len]).ok()?;
    let rec = match layout::parts_of(kind) {
        // a put of a shape the store never writes is not a record either (see `no_record_is_found_inside_an_accepted_key`)
        Some(parts) if put_shape_ok(u32_at(b, layout::CLASS.at), u64_at(b, layout::LEN.at)) => {
            // the offset of each optional part the kind carries
            let part = |p: PutParts| parts.has(p).then(|| parts.at(p));
            let coded = part(PutParts::CODED).map(|o| u64_at(b, o));
            // a coded object decodes to at least one byte, at most what the store takes
            if coded.is_some_and(|c| c == 0 || c > super::MAX_OBJECT) {
                return None;
            }
            RecordRef::Put {
                key,
                at: Placement {
                    class: u32_at(b, layout::CLASS.at),
                    slot: u32_at(b, layout::SLOT.at),
                    len: u64_at(b, layout::LEN.at),
                    crc: u32_at(b, layout::CRC.at),
                    seal: part(PutParts::SEALED)
                        .map(|o| b[o..o + SEAL_LEN].try_into().expect("SEAL_LEN bytes")),
                    coded,
                },
            }
        }
        // a del's unused fields are zero (as `encode` writes them): one fewer way for bytes that are not a
        // record to pass for one
        None if kind == layout::DEL && b[layout::CLASS.at..FIXED].iter().all(|&x| x == 0) => {
            RecordRef::Del { key }
        }
        _ => return None,
    };
    Some((rec, total))
}

#[cfg(test)]
mod tests;

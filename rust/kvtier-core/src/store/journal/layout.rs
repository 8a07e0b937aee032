//! Where each field of a journal record lies: the one definition of the record layout. The journal's
//! encoder and parser, the disk fuzzer and docs/STORE.md's layout table (`table`, checked against the
//! document by a test) all take it from here.
//!
//! A record is the fixed fields ([`MAGIC_FIELD`] to [`CRC`], [`FIXED`] bytes), then a coded put's decoded
//! length ([`DECODED_LEN`]), then a sealed put's seal ([`SEAL_LEN`] bytes), then the key
//! ([`key_at`] gives where it starts), then the record's own crc32c ([`RECORD_CRC_LEN`] bytes).
//! Every integer is little-endian.

use super::MAGIC;
use crate::seal::SEAL_LEN;

/// One fixed-place field of a record: `len` bytes at offset `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// Offset of its first byte in the record.
    pub at: usize,
    /// Its bytes.
    pub len: usize,
}

impl Field {
    /// The field of `len` bytes right after `prev`.
    const fn after(prev: Field, len: usize) -> Field {
        Field {
            at: prev.at + prev.len,
            len,
        }
    }
    /// Offset of the byte after it.
    pub const fn end(self) -> usize {
        self.at + self.len
    }
    /// Its bytes' range in a record.
    pub const fn range(self) -> std::ops::Range<usize> {
        self.at..self.end()
    }
}

/// `u32`: [`MAGIC`], where every record starts.
pub const MAGIC_FIELD: Field = Field { at: 0, len: 4 };
/// `u8`: one of [`PUT`], [`DEL`], [`SEALED_PUT`], [`CODED_PUT`], [`CODED_SEALED_PUT`].
pub const KIND: Field = Field::after(MAGIC_FIELD, 1);
/// `u16`: bytes of the key.
pub const KEY_LEN: Field = Field::after(KIND, 2);
/// `u32`: the size class (zero in a del).
pub const CLASS: Field = Field::after(KEY_LEN, 4);
/// `u32`: the slot in the class's data file (zero in a del).
pub const SLOT: Field = Field::after(CLASS, 4);
/// `u64`: the stored object's length (zero in a del).
pub const LEN: Field = Field::after(SLOT, 8);
/// `u32`: crc32c of the stored bytes followed by the key (zero in a del).
pub const CRC: Field = Field::after(LEN, 4);
/// Bytes of the fields every record has before its key.
pub const FIXED: usize = CRC.end();
/// `u64`, coded puts only: the length the object decodes to.
pub const DECODED_LEN: Field = Field::after(CRC, 8);
/// Bytes of the record's trailing crc32c, of every byte before it.
pub const RECORD_CRC_LEN: usize = 4;

/// A put of an object stored in clear, as given.
pub const PUT: u8 = 1;
/// A delete.
pub const DEL: u8 = 2;
/// A put of an object sealed at rest.
pub const SEALED_PUT: u8 = 3;
/// A put of an object stored compressed.
pub const CODED_PUT: u8 = 4;
/// A put of an object compressed, then sealed.
pub const CODED_SEALED_PUT: u8 = 5;

/// Whether a record of `kind` carries [`DECODED_LEN`].
pub const fn is_coded(kind: u8) -> bool {
    kind == CODED_PUT || kind == CODED_SEALED_PUT
}
/// Whether a record of `kind` carries a seal.
pub const fn is_sealed(kind: u8) -> bool {
    kind == SEALED_PUT || kind == CODED_SEALED_PUT
}
/// The kind of a put record: sealed or not, coded or not.
pub const fn put_kind(sealed: bool, coded: bool) -> u8 {
    match (sealed, coded) {
        (false, false) => PUT,
        (true, false) => SEALED_PUT,
        (false, true) => CODED_PUT,
        (true, true) => CODED_SEALED_PUT,
    }
}
/// Offset of a record's seal, when its kind has one.
pub const fn seal_at(kind: u8) -> usize {
    FIXED + if is_coded(kind) { DECODED_LEN.len } else { 0 }
}
/// Offset of a record's key: after the fixed fields, the decoded length and the seal its kind has.
pub const fn key_at(kind: u8) -> usize {
    seal_at(kind) + if is_sealed(kind) { SEAL_LEN } else { 0 }
}
/// Bytes of a whole record of `kind` with a `key_len`-byte key.
pub const fn record_len(kind: u8, key_len: usize) -> usize {
    key_at(kind) + key_len + RECORD_CRC_LEN
}

/// docs/STORE.md's table of the record layout, made from the constants above (a test holds the
/// document to it): a field's type is its width (`u{8 * len}`), the magic's value is [`MAGIC`].
#[doc(hidden)]
pub fn table() -> String {
    let uint = |len: usize| format!("u{}", 8 * len);
    let magic = String::from_utf8_lossy(&MAGIC.to_be_bytes()).into_owned();
    let fixed = [
        (
            MAGIC_FIELD,
            "magic",
            format!("{} = {MAGIC:#x} (\"{magic}\")", uint(MAGIC_FIELD.len)),
            "every record",
        ),
        (
            KIND,
            "kind",
            format!(
                "{}: {PUT} put, {DEL} del, {SEALED_PUT} sealed put, {CODED_PUT} coded put, \
                 {CODED_SEALED_PUT} coded sealed put",
                uint(KIND.len)
            ),
            "every record",
        ),
        (KEY_LEN, "key_len", uint(KEY_LEN.len), "every record"),
        (CLASS, "class", uint(CLASS.len), "zero in a del"),
        (SLOT, "slot", uint(SLOT.len), "zero in a del"),
        (LEN, "len", uint(LEN.len), "zero in a del"),
        (CRC, "crc", uint(CRC.len), "zero in a del"),
    ];
    let mut out = String::from("| offset | field | bytes | type | in |\n|---|---|---|---|---|\n");
    for (f, name, ty, r#in) in fixed {
        out += &format!("| {} | {name} | {} | {ty} | {in} |\n", f.at, f.len);
    }
    let (c, s) = (CODED_PUT, SEALED_PUT);
    let (cs, p) = (CODED_SEALED_PUT, PUT);
    out += &format!(
        "| {} | decoded_len | {} | {} | kinds {c} and {cs} |\n",
        DECODED_LEN.at,
        DECODED_LEN.len,
        uint(DECODED_LEN.len)
    );
    out += &format!(
        "| {} (kind {s}), {} (kind {cs}) | seal | {SEAL_LEN} | nonce, tag, key id | kinds {s} and {cs} |\n",
        seal_at(s),
        seal_at(cs)
    );
    out += &format!(
        "| {} (kinds {p}, {DEL}), {} (kind {c}), {} (kind {s}), {} (kind {cs}) | key | key_len | UTF-8 | \
         every record |\n",
        key_at(p),
        key_at(c),
        key_at(s),
        key_at(cs)
    );
    out += &format!(
        "| key's end | record_crc | {RECORD_CRC_LEN} | {}: crc32c of every byte before it | every record |\n",
        uint(RECORD_CRC_LEN)
    );
    out += &format!(
        "\nA del or a clear put is `{} + key_len` bytes, a coded put `{} + key_len`, a sealed put\n\
         `{} + key_len`, a coded sealed put `{} + key_len`.\n",
        record_len(p, 0),
        record_len(c, 0),
        record_len(s, 0),
        record_len(cs, 0)
    );
    out
}

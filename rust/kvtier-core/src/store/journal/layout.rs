//! Where each field of a journal record lies: the one definition of the record layout. The journal's
//! encoder and parser, the disk fuzzer and docs/STORE.md's layout table (`table`, checked against the
//! document by a test) all take it from here.
//!
//! A record is the fixed fields ([`MAGIC_FIELD`] to [`CRC`], [`FIXED`] bytes), then the optional parts its
//! kind says it carries ([`KINDS`], [`PutParts`]), in [`PARTS`]' order (a coded put's decoded length, a
//! sealed put's seal), then the key ([`key_at`] gives where it starts), then the record's own crc32c
//! ([`RECORD_CRC_LEN`] bytes). Every integer is little-endian.

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
/// `u8`: one of [`KINDS`].
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

/// Which optional parts a put record carries, one bit per part ([`PARTS`]): a put's kind tells it
/// ([`KINDS`]), and its length, the journal bytes a put reserves and the longest record
/// ([`PutParts::ALL`]) all follow from it, so a new optional part changes none of those. `journal::PutParts::of` gives a `Placement`'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutParts(u8);

impl PutParts {
    /// No optional part: a put of an object stored in clear, as given (and what a del carries).
    pub const NONE: PutParts = PutParts(0);
    /// The decoded length: an object stored compressed (`crate::codec`).
    pub const CODED: PutParts = PutParts(1);
    /// The seal: an object sealed at rest (`crate::seal`).
    pub const SEALED: PutParts = PutParts(1 << 1);
    /// Every optional part: what the longest put record carries.
    pub const ALL: PutParts = {
        let (mut bits, mut i) = (0, 0);
        while i < PARTS.len() {
            bits |= PARTS[i].bit.0;
            i += 1;
        }
        PutParts(bits)
    };

    /// These parts and `part` too when `on`.
    pub const fn with(self, part: PutParts, on: bool) -> PutParts {
        if on {
            PutParts(self.0 | part.0)
        } else {
            self
        }
    }
    /// Whether it carries `part`.
    pub const fn has(self, part: PutParts) -> bool {
        self.0 & part.0 == part.0
    }
    /// Offset of `part` in a put record of these parts: after the fixed fields and the parts before it in
    /// [`PARTS`] that it carries.
    pub const fn at(self, part: PutParts) -> usize {
        let mut i = 0;
        while i < PARTS.len() && PARTS[i].bit.0 != part.0 {
            i += 1;
        }
        self.end_of(i)
    }
    /// Offset of the key in a put record of these parts: after the fixed fields and every part it carries.
    pub const fn key_at(self) -> usize {
        self.end_of(PARTS.len())
    }
    /// Offset of the byte after the fixed fields and those of the first `n` parts it carries.
    const fn end_of(self, n: usize) -> usize {
        let (mut at, mut i) = (FIXED, 0);
        while i < n {
            if self.has(PARTS[i].bit) {
                at += PARTS[i].len;
            }
            i += 1;
        }
        at
    }
    /// Bytes of a whole put record of these parts with a `key_len`-byte key.
    pub const fn record_len(self, key_len: usize) -> usize {
        self.key_at() + key_len + RECORD_CRC_LEN
    }
}

/// One optional part of a put record.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    /// The bit of [`PutParts`] that says a record carries it.
    pub bit: PutParts,
    /// Its name in docs/STORE.md's table.
    pub name: &'static str,
    /// Its bytes.
    pub len: usize,
    /// Its type in docs/STORE.md's table.
    pub ty: &'static str,
}

/// The optional parts, in the order they lie in a record: after the fixed fields, before the key.
pub const PARTS: &[Part] = &[
    Part {
        bit: PutParts::CODED,
        name: "decoded_len",
        len: 8,
        ty: "u64",
    },
    Part {
        bit: PutParts::SEALED,
        name: "seal",
        len: SEAL_LEN,
        ty: "nonce, tag, key id",
    },
];

/// One record kind.
#[derive(Clone, Copy, Debug)]
pub struct Kind {
    /// Its byte in [`KIND`].
    pub kind: u8,
    /// Its name in docs/STORE.md's table.
    pub name: &'static str,
    /// The parts a put of this kind carries; `None`: not a put.
    pub put: Option<PutParts>,
}

/// Every record kind: the one map between a kind's byte and the parts its put carries. Every combination of
/// parts has exactly one put kind here (a test checks each); a kind number is never reused, so that
/// a reader of an older format finds no kind it knows in a record of a newer one.
pub const KINDS: &[Kind] = &[
    Kind {
        kind: PUT,
        name: "put",
        put: Some(PutParts::NONE),
    },
    Kind {
        kind: DEL,
        name: "del",
        put: None,
    },
    Kind {
        kind: SEALED_PUT,
        name: "sealed put",
        put: Some(PutParts::SEALED),
    },
    Kind {
        kind: CODED_PUT,
        name: "coded put",
        put: Some(PutParts::CODED),
    },
    Kind {
        kind: CODED_SEALED_PUT,
        name: "coded sealed put",
        put: Some(PutParts::CODED.with(PutParts::SEALED, true)),
    },
];

/// The parts a put of `kind` carries; `None` for a del or a kind that is not one ([`KINDS`]).
pub const fn parts_of(kind: u8) -> Option<PutParts> {
    let mut i = 0;
    while i < KINDS.len() {
        if KINDS[i].kind == kind {
            return KINDS[i].put;
        }
        i += 1;
    }
    None
}
/// The kind of a put record carrying `parts` ([`KINDS`]). Panics for parts no kind has.
pub const fn put_kind(parts: PutParts) -> u8 {
    let mut i = 0;
    while i < KINDS.len() {
        if let Some(s) = KINDS[i].put {
            if s.0 == parts.0 {
                return KINDS[i].kind;
            }
        }
        i += 1;
    }
    panic!("put parts with no kind in layout::KINDS")
}
/// Offset of a record's key: after the fixed fields and the parts its kind carries (none in a del).
pub const fn key_at(kind: u8) -> usize {
    match parts_of(kind) {
        Some(s) => s.key_at(),
        None => FIXED,
    }
}
/// Bytes of a whole record of `kind` with a `key_len`-byte key.
pub const fn record_len(kind: u8, key_len: usize) -> usize {
    key_at(kind) + key_len + RECORD_CRC_LEN
}

/// docs/STORE.md's table of the record layout, made from the constants above (a test holds the
/// document to it): a field's type is its width (`u{8 * len}`), the magic's value is [`MAGIC`]; an optional
/// part's row and the key's offsets come from [`PARTS`] and [`KINDS`].
#[doc(hidden)]
pub fn table() -> String {
    let uint = |len: usize| format!("u{}", 8 * len);
    let magic = String::from_utf8_lossy(&MAGIC.to_be_bytes()).into_owned();
    let mut kinds: Vec<Kind> = KINDS.to_vec();
    kinds.sort_by_key(|k| k.kind);
    let names: Vec<String> = kinds
        .iter()
        .map(|k| format!("{} {}", k.kind, k.name))
        .collect();
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
            format!("{}: {}", uint(KIND.len), names.join(", ")),
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
    for part in PARTS {
        let with: Vec<(usize, u8)> = kinds
            .iter()
            .filter_map(|k| {
                let s = k.put.filter(|s| s.has(part.bit))?;
                Some((s.at(part.bit), k.kind))
            })
            .collect();
        let ks: Vec<u8> = with.iter().map(|w| w.1).collect();
        out += &format!(
            "| {} | {} | {} | {} | {} |\n",
            offsets(&with),
            part.name,
            part.len,
            part.ty,
            kind_list(&ks)
        );
    }
    let keys: Vec<(usize, u8)> = kinds.iter().map(|k| (key_at(k.kind), k.kind)).collect();
    out += &format!(
        "| {} | key | key_len | UTF-8 | every record |\n",
        offsets(&keys)
    );
    out += &format!(
        "| key's end | record_crc | {RECORD_CRC_LEN} | {}: crc32c of every byte before it | every record |\n",
        uint(RECORD_CRC_LEN)
    );
    // the records' lengths, shortest first, in lines of at most 110 characters
    let mut puts: Vec<Kind> = kinds
        .iter()
        .filter(|k| k.kind != PUT && k.put.is_some())
        .copied()
        .collect();
    puts.sort_by_key(|k| (record_len(k.kind, 0), k.kind));
    let mut clauses = vec![format!(
        "A del or a clear put is `{} + key_len` bytes",
        record_len(PUT, 0)
    )];
    clauses.extend(puts.iter().map(|k| {
        let a = if k.name.starts_with(['a', 'e', 'i', 'o', 'u']) {
            "an"
        } else {
            "a"
        };
        format!("{a} {} `{} + key_len`", k.name, record_len(k.kind, 0))
    }));
    let mut line = String::new();
    out.push('\n');
    for (i, c) in clauses.iter().enumerate() {
        let c = if i + 1 == clauses.len() {
            format!("{c}.")
        } else {
            format!("{c},")
        };
        if !line.is_empty() && line.len() + 1 + c.len() > 110 {
            out += &format!("{line}\n");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line += &c;
    }
    out += &format!("{line}\n");
    out
}

/// `27` where every kind has the same offset, else `27 (kinds 1, 2), 35 (kind 4)`: `(offset, kind)` pairs
/// grouped by offset.
fn offsets(with: &[(usize, u8)]) -> String {
    let mut with = with.to_vec();
    with.sort();
    if with.windows(2).all(|w| w[0].0 == w[1].0) {
        return with.first().map_or(String::new(), |w| w.0.to_string());
    }
    let mut groups: Vec<(usize, Vec<u8>)> = Vec::new();
    for (at, k) in with {
        match groups.last_mut() {
            Some(g) if g.0 == at => g.1.push(k),
            _ => groups.push((at, vec![k])),
        }
    }
    let groups: Vec<String> = groups
        .iter()
        .map(|(at, ks)| {
            let ks: Vec<String> = ks.iter().map(u8::to_string).collect();
            let s = if ks.len() > 1 { "s" } else { "" };
            format!("{at} (kind{s} {})", ks.join(", "))
        })
        .collect();
    groups.join(", ")
}

/// `kind 4`, `kinds 4 and 5`, `kinds 4, 5 and 7`.
fn kind_list(ks: &[u8]) -> String {
    let ks: Vec<String> = ks.iter().map(u8::to_string).collect();
    match ks.split_last() {
        None => String::new(),
        Some((last, [])) => format!("kind {last}"),
        Some((last, rest)) => format!("kinds {} and {last}", rest.join(", ")),
    }
}

//! Lossless compression of KV page objects, built for what KV is: floating-point values whose mantissa
//! bits are noise and whose exponents cluster (docs/STORE.md, "Compressed objects").
//!
//! An object is cut into chunks of [`CHUNK`] raw bytes, each coded on its own (so chunks decode in
//! parallel and a damaged one costs the object, never a neighbour's bytes):
//!
//! - [`Elem::Bits16`] (bf16, fp16): each value's bits 14..7 (bf16: the exponent) form a symbol plane,
//!   coded with a Huffman code of the chunk's own; the sign and the low 7 bits form a second plane, stored
//!   as they are. bf16 KV of a real model takes about 10.9 bits a value.
//! - [`Elem::Bits8`] (fp8): each byte's bits 6..3 (e4m3: the exponent) form the symbol plane, Huffman-coded;
//!   the sign and bits 2..0 form a plane of nibbles, two a byte, stored as they are.
//!
//! A chunk that does not shrink is stored raw; a chunk of one repeated symbol stores it once. Layout
//! (little-endian):
//!
//! ```text
//! magic "KVTC" | version u8 = 1 | elem u8 (1 = Bits16, 2 = Bits8) | 0 u16 | raw_len u64 | chunk u32 |
//! chunks u32 | chunks × (end u32, crc u32) | chunk data ...
//! chunk data: mode u8 (0 raw | 1 coded | 2 one symbol) then
//!   raw:   the chunk's bytes
//!   coded: table [128] | 4 × stream length u32 | streams | rest plane | tail
//!   one:   the symbol u8 | rest plane | tail
//! rest plane: Bits16 one byte a value; Bits8 a nibble a value, two a byte (the first in the low nibble)
//! ```
//!
//! `end` is where each chunk's data ends in the object; `crc` is the crc32c of the chunk's decoded bytes,
//! checked after decoding, so a decoder fault is a failed read, never a wrong byte (the store's own
//! checksum covers the stored bytes before any of this runs). The tail is the byte of an odd-length
//! `Bits16` chunk that is no whole value. Decoding never panics and never writes outside its output,
//! whatever the bytes (tests feed it damaged and random input).

mod huffman;

use huffman::Damaged;

/// Raw bytes a chunk covers (the last chunk of an object may be shorter).
pub const CHUNK: usize = 256 << 10;
/// The container's magic.
pub const MAGIC: [u8; 4] = *b"KVTC";
const VERSION: u8 = 1;
const HEADER: usize = 24;
const RAW: u8 = 0;
const CODED: u8 = 1;
const ONE: u8 = 2;

/// How an object's bytes are read as values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    /// 16-bit floats (bf16, fp16): bits 14..7 coded, the sign and bits 6..0 stored.
    Bits16,
    /// 8-bit values (fp8 e4m3 and e5m2): bits 6..3 coded, the sign and bits 2..0 stored.
    Bits8,
}

impl Elem {
    fn id(self) -> u8 {
        match self {
            Elem::Bits16 => 1,
            Elem::Bits8 => 2,
        }
    }

    fn from_id(id: u8) -> Option<Self> {
        match id {
            1 => Some(Elem::Bits16),
            2 => Some(Elem::Bits8),
            _ => None,
        }
    }

    /// The codec for a KV dtype name as torch spells it (`bfloat16`, `float16`, `float8_e4m3fn`, ...), or
    /// `None` for one it does not compress (32-bit floats, integers).
    pub fn for_dtype(dtype: &str) -> Option<Self> {
        let d = dtype.trim_start_matches("torch.");
        match d {
            "bfloat16" | "bf16" | "float16" | "half" | "fp16" => Some(Elem::Bits16),
            _ if d.starts_with("float8") || d.starts_with("fp8") => Some(Elem::Bits8),
            _ => None,
        }
    }

    /// The codec's name (`"bits16"`, `"bits8"`), as [`Elem::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Elem::Bits16 => "bits16",
            Elem::Bits8 => "bits8",
        }
    }

    /// The codec named `name` ([`Elem::name`]).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "bits16" => Some(Elem::Bits16),
            "bits8" => Some(Elem::Bits8),
            _ => None,
        }
    }
}

/// Why a coded object did not decode: its bytes are not an object this codec wrote, or are damaged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "coded object does not decode: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

impl From<Damaged> for DecodeError {
    fn from(_: Damaged) -> Self {
        DecodeError("a coded stream does not end where its length says")
    }
}

/// The most bytes [`encode`] writes for `raw_len` raw bytes (every chunk raw, plus the header).
pub fn max_encoded_len(raw_len: usize) -> usize {
    let chunks = raw_len.div_ceil(CHUNK);
    HEADER + 9 * chunks + raw_len
}

/// Appends the coded form of `raw` to `out`; returns the bytes appended. Never fails: what does not shrink
/// is stored raw, chunk by chunk (the caller compares the length with `raw.len()` to decide whether
/// coding paid).
pub fn encode(raw: &[u8], elem: Elem, out: &mut Vec<u8>) -> usize {
    encode_with(raw, elem, out, false).expect("never given up")
}

/// As [`encode`], but gives up (`None`, `out` as it was) as soon as the first chunk does not shrink: bytes
/// that are not values of this kind (random, encrypted, another dtype) cost one chunk's look, not a coding.
pub fn encode_shrinking(raw: &[u8], elem: Elem, out: &mut Vec<u8>) -> Option<usize> {
    encode_with(raw, elem, out, true)
}

fn encode_with(raw: &[u8], elem: Elem, out: &mut Vec<u8>, give_up: bool) -> Option<usize> {
    let start = out.len();
    let chunks = raw.len().div_ceil(CHUNK);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(elem.id());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(raw.len() as u64).to_le_bytes());
    out.extend_from_slice(&(CHUNK as u32).to_le_bytes());
    out.extend_from_slice(&(chunks as u32).to_le_bytes());
    let table = out.len();
    out.resize(table + 8 * chunks, 0);
    let mut scratch = Planes::default();
    for (c, piece) in raw.chunks(CHUNK).enumerate() {
        let at_chunk = out.len();
        encode_chunk(piece, elem, &mut scratch, out);
        if give_up && c == 0 && out[at_chunk] == RAW {
            out.truncate(start);
            return None;
        }
        let end = (out.len() - start) as u32;
        let crc = crate::hash::bulk_crc(piece);
        let at = table + 8 * c;
        out[at..at + 4].copy_from_slice(&end.to_le_bytes());
        out[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
    }
    Some(out.len() - start)
}

/// Reusable planes of one chunk.
#[derive(Default)]
struct Planes {
    syms: Vec<u8>,
    rest: Vec<u8>,
}

fn encode_chunk(raw: &[u8], elem: Elem, p: &mut Planes, out: &mut Vec<u8>) {
    let at = out.len();
    let (syms, rest, tail): (&[u8], &[u8], &[u8]) = match elem {
        Elem::Bits16 => {
            let n = raw.len() / 2;
            p.syms.resize(n, 0);
            p.rest.resize(n, 0);
            split16(&raw[..2 * n], &mut p.syms, &mut p.rest);
            (&p.syms, &p.rest, &raw[2 * n..])
        }
        Elem::Bits8 => {
            let n = raw.len();
            p.syms.resize(n, 0);
            p.rest.resize(n.div_ceil(2), 0);
            split8(raw, &mut p.syms, &mut p.rest);
            (&p.syms, &p.rest, &[])
        }
    };
    let counts = histogram(syms);
    if let Some(s) = counts.iter().position(|&c| c as usize == syms.len()) {
        if !syms.is_empty() && 2 + rest.len() + tail.len() < raw.len() {
            out.push(ONE);
            out.push(s as u8);
            out.extend_from_slice(rest);
            out.extend_from_slice(tail);
            return;
        }
    }
    if let Some(lens) = huffman::lengths(&counts) {
        let bits = huffman::coded_bits(&counts, &lens);
        let coded = 1 + huffman::TABLE_BYTES + 16 + bits.div_ceil(8) as usize + 4 + rest.len();
        if coded < raw.len() {
            out.push(CODED);
            huffman::write_table(&lens, out);
            huffman::encode4(syms, &lens, out);
            out.extend_from_slice(rest);
            out.extend_from_slice(tail);
            debug_assert!(out.len() - at < raw.len() + 1);
            return;
        }
    }
    out.push(RAW);
    out.extend_from_slice(raw);
}

/// The symbol plane (bits 14..7) and the rest (sign, bits 6..0) of little-endian 16-bit values.
fn split16(raw: &[u8], syms: &mut [u8], rest: &mut [u8]) {
    let n = syms.len().min(rest.len()).min(raw.len() / 2);
    let (raw, syms, rest) = (&raw[..2 * n], &mut syms[..n], &mut rest[..n]);
    // blocks of 16 values in fixed-size arrays: the compiler keeps them in vector registers
    let blocks = n / 16;
    for b in 0..blocks {
        let r: &[u8; 32] = raw[32 * b..32 * b + 32].try_into().expect("32 bytes");
        let s: &mut [u8; 16] = (&mut syms[16 * b..16 * b + 16])
            .try_into()
            .expect("16 bytes");
        let t: &mut [u8; 16] = (&mut rest[16 * b..16 * b + 16])
            .try_into()
            .expect("16 bytes");
        for i in 0..16 {
            let (lo, hi) = (r[2 * i], r[2 * i + 1]);
            s[i] = (hi << 1) | (lo >> 7);
            t[i] = (hi & 0x80) | (lo & 0x7f);
        }
    }
    for i in 16 * blocks..n {
        let (lo, hi) = (raw[2 * i], raw[2 * i + 1]);
        syms[i] = (hi << 1) | (lo >> 7);
        rest[i] = (hi & 0x80) | (lo & 0x7f);
    }
}

/// The inverse of [`split16`].
fn merge16(syms: &[u8], rest: &[u8], out: &mut [u8]) {
    let n = syms.len().min(rest.len()).min(out.len() / 2);
    let (syms, rest, out) = (&syms[..n], &rest[..n], &mut out[..2 * n]);
    let blocks = n / 16;
    for b in 0..blocks {
        let s: &[u8; 16] = syms[16 * b..16 * b + 16].try_into().expect("16 bytes");
        let t: &[u8; 16] = rest[16 * b..16 * b + 16].try_into().expect("16 bytes");
        let o: &mut [u8; 32] = (&mut out[32 * b..32 * b + 32])
            .try_into()
            .expect("32 bytes");
        for i in 0..16 {
            o[2 * i] = (s[i] << 7) | (t[i] & 0x7f);
            o[2 * i + 1] = (t[i] & 0x80) | (s[i] >> 1);
        }
    }
    for i in 16 * blocks..n {
        out[2 * i] = (syms[i] << 7) | (rest[i] & 0x7f);
        out[2 * i + 1] = (rest[i] & 0x80) | (syms[i] >> 1);
    }
}

/// The symbol plane (bits 6..3) and the rest (the sign and bits 2..0, a nibble a value, two a byte) of bytes.
fn split8(raw: &[u8], syms: &mut [u8], rest: &mut [u8]) {
    let n = raw.len().min(syms.len()).min(2 * rest.len());
    let nib = |b: u8| ((b & 0x80) >> 4) | (b & 0x07);
    let pairs = n / 2;
    for ((r, s), t) in raw[..2 * pairs]
        .chunks_exact(2)
        .zip(syms[..2 * pairs].chunks_exact_mut(2))
        .zip(rest[..pairs].iter_mut())
    {
        s[0] = (r[0] >> 3) & 0x0f;
        s[1] = (r[1] >> 3) & 0x0f;
        *t = nib(r[0]) | (nib(r[1]) << 4);
    }
    if n % 2 == 1 {
        syms[n - 1] = (raw[n - 1] >> 3) & 0x0f;
        rest[pairs] = nib(raw[n - 1]);
    }
}

/// The inverse of [`split8`].
fn merge8(syms: &[u8], rest: &[u8], out: &mut [u8]) {
    let n = out.len().min(syms.len()).min(2 * rest.len());
    let byte = |s: u8, r: u8| ((r & 0x08) << 4) | ((s & 0x0f) << 3) | (r & 0x07);
    let pairs = n / 2;
    for ((o, s), &t) in out[..2 * pairs]
        .chunks_exact_mut(2)
        .zip(syms[..2 * pairs].chunks_exact(2))
        .zip(rest[..pairs].iter())
    {
        o[0] = byte(s[0], t);
        o[1] = byte(s[1], t >> 4);
    }
    if n % 2 == 1 {
        out[n - 1] = byte(syms[n - 1], rest[pairs]);
    }
}

fn histogram(syms: &[u8]) -> [u64; 256] {
    // four tables, so that runs of one symbol do not wait on the same counter
    let mut h = [[0u32; 256]; 4];
    let mut it = syms.chunks_exact(4);
    for q in &mut it {
        h[0][q[0] as usize] += 1;
        h[1][q[1] as usize] += 1;
        h[2][q[2] as usize] += 1;
        h[3][q[3] as usize] += 1;
    }
    for &s in it.remainder() {
        h[0][s as usize] += 1;
    }
    let mut out = [0u64; 256];
    for (i, o) in out.iter_mut().enumerate() {
        *o = h.iter().map(|t| u64::from(t[i])).sum();
    }
    out
}

/// A coded object's header, read and checked: where each chunk's data is and what it decodes to.
#[derive(Debug, Clone)]
pub struct Header {
    /// How its values are coded.
    pub elem: Elem,
    /// Bytes it decodes to.
    pub raw_len: usize,
    chunk: usize,
    /// `(start, end, crc)` of each chunk's data in the object.
    spans: Vec<(usize, usize, u32)>,
}

impl Header {
    /// Reads the header of the coded object `b`; an error unless it is one this codec wrote, of a
    /// consistent shape (the chunks' data in order inside `b`, as many chunks as `raw_len` needs).
    pub fn parse(b: &[u8]) -> Result<Header, DecodeError> {
        if b.len() < HEADER || b[..4] != MAGIC {
            return Err(DecodeError("no codec header"));
        }
        if b[4] != VERSION {
            return Err(DecodeError("a codec version this kvtier does not read"));
        }
        let elem = Elem::from_id(b[5]).ok_or(DecodeError("unknown element kind"))?;
        let raw_len = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let chunk = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")) as usize;
        let chunks = u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")) as usize;
        let raw_len = usize::try_from(raw_len).map_err(|_| DecodeError("raw length"))?;
        // (the one chunk size `encode` writes: a crafted header cannot make a chunk's planes huge)
        if chunk != CHUNK || chunks != raw_len.div_ceil(chunk) {
            return Err(DecodeError(
                "chunk size and count do not match the raw length",
            ));
        }
        let data = HEADER
            .checked_add(chunks.checked_mul(8).ok_or(DecodeError("chunk count"))?)
            .filter(|&d| d <= b.len())
            .ok_or(DecodeError("chunk table past the end"))?;
        let mut spans = Vec::with_capacity(chunks);
        let mut start = data;
        for c in 0..chunks {
            let at = HEADER + 8 * c;
            let end = u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(b[at + 4..at + 8].try_into().expect("4 bytes"));
            if end <= start || end > b.len() {
                return Err(DecodeError("chunk data out of order or past the end"));
            }
            spans.push((start, end, crc));
            start = end;
        }
        Ok(Header {
            elem,
            raw_len,
            chunk,
            spans,
        })
    }

    /// How many chunks the object has.
    pub fn chunks(&self) -> usize {
        self.spans.len()
    }

    /// The raw byte range chunk `c` decodes to.
    pub fn raw_range(&self, c: usize) -> std::ops::Range<usize> {
        let a = c * self.chunk;
        a..(a + self.chunk).min(self.raw_len)
    }

    /// How many chunks, from the first, cover the first `prefix` raw bytes.
    pub fn chunks_covering(&self, prefix: usize) -> usize {
        prefix.div_ceil(self.chunk).min(self.spans.len())
    }

    /// The bytes of the coded object that hold chunks `..c`'s data (a prefix read of the object that
    /// covers them decodes them).
    pub fn coded_end(&self, c: usize) -> usize {
        match c {
            0 => self.spans.first().map_or(HEADER, |s| s.0),
            c => self.spans[c.min(self.spans.len()) - 1].1,
        }
    }

    /// Decodes chunk `c` of the object `b` into `out` (exactly [`Header::raw_range`]`(c)`'s length) and
    /// checks its crc32c.
    pub fn decode_chunk(&self, b: &[u8], c: usize, out: &mut [u8]) -> Result<(), DecodeError> {
        let (start, end, crc) = self.spans[c];
        if out.len() != self.raw_range(c).len() {
            return Err(DecodeError("output of the wrong length"));
        }
        let data = b.get(start..end).ok_or(DecodeError("chunk past the end"))?;
        SCRATCH.with(|s| decode_chunk(data, self.elem, &mut s.borrow_mut(), out))?;
        if crate::hash::bulk_crc(out) != crc {
            return Err(DecodeError("a decoded chunk fails its checksum"));
        }
        Ok(())
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Planes> = std::cell::RefCell::new(Planes::default());
}

fn decode_chunk(d: &[u8], elem: Elem, p: &mut Planes, out: &mut [u8]) -> Result<(), DecodeError> {
    let (&mode, body) = d.split_first().ok_or(DecodeError("empty chunk"))?;
    let n = match elem {
        Elem::Bits16 => out.len() / 2,
        Elem::Bits8 => out.len(),
    };
    let rest_len = match elem {
        Elem::Bits16 => n + out.len() % 2,
        Elem::Bits8 => n.div_ceil(2),
    };
    let planes = match mode {
        RAW => {
            if body.len() != out.len() {
                return Err(DecodeError("raw chunk of the wrong length"));
            }
            out.copy_from_slice(body);
            return Ok(());
        }
        ONE => {
            let (&s, rest) = body.split_first().ok_or(DecodeError("empty chunk"))?;
            if rest.len() != rest_len {
                return Err(DecodeError("chunk of the wrong length"));
            }
            p.syms.clear();
            p.syms.resize(n, s);
            rest
        }
        CODED => {
            let lens = huffman::read_table(body).ok_or(DecodeError("invalid code table"))?;
            let table = huffman::decode_table(&lens);
            let body = &body[huffman::TABLE_BYTES..];
            p.syms.resize(n, 0);
            let used = huffman::decode4(body, &table, &mut p.syms)?;
            let rest = &body[used..];
            if rest.len() != rest_len {
                return Err(DecodeError("chunk of the wrong length"));
            }
            rest
        }
        _ => return Err(DecodeError("unknown chunk mode")),
    };
    match elem {
        Elem::Bits16 => {
            merge16(&p.syms, &planes[..n], &mut out[..2 * n]);
            out[2 * n..].copy_from_slice(&planes[n..]);
        }
        Elem::Bits8 => merge8(&p.syms, planes, out),
    }
    Ok(())
}

/// Decodes the whole coded object `b` into `out` (of exactly its raw length), every chunk checked.
pub fn decode(b: &[u8], out: &mut [u8]) -> Result<(), DecodeError> {
    let h = Header::parse(b)?;
    if out.len() != h.raw_len {
        return Err(DecodeError("output of the wrong length"));
    }
    for c in 0..h.chunks() {
        let r = h.raw_range(c);
        h.decode_chunk(b, c, &mut out[r])?;
    }
    Ok(())
}

/// Whether `b` starts like a coded object (its magic); [`Header::parse`] says whether it is one.
pub fn is_coded(b: &[u8]) -> bool {
    b.len() >= 4 && b[..4] == MAGIC
}

#[cfg(test)]
pub(crate) mod tests;

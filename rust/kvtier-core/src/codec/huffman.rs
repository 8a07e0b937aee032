//! Canonical Huffman codes of byte symbols, at most [`MAX_LEN`] bits long: building them from counts,
//! their compact table (one nibble a symbol), writing four interleaved streams and reading them back.
//!
//! Bits are written least significant first, each code bit-reversed, so a reader takes the next code from
//! the low bits of a little-endian word: one table look-up of [`MAX_LEN`] bits gives the symbol and its
//! length. Every code the builder makes is complete (Kraft sum exactly 1), and a table read from bytes is
//! accepted only if it is too, so every look-up hits a symbol: a reader of damaged bytes decodes garbage
//! of the right length, never loops, never reads or writes out of bounds, and the stream's end check or
//! the caller's checksum catches it.

/// Longest code: the look-up table has `1 << MAX_LEN` entries (4 KiB, in L1).
pub const MAX_LEN: u32 = 11;
/// Bytes of a code table: a nibble (the code length, 0 = absent) for each of the 256 symbols.
pub const TABLE_BYTES: usize = 128;

/// Code lengths (0 = symbol absent) of a complete length-limited Huffman code for `counts`, or `None`
/// when fewer than two symbols occur (the caller stores such a chunk another way).
pub fn lengths(counts: &[u64; 256]) -> Option<[u8; 256]> {
    let mut syms: Vec<(u64, u8)> = (0..256)
        .filter(|&s| counts[s] > 0)
        .map(|s| (counts[s], s as u8))
        .collect();
    if syms.len() < 2 {
        return None;
    }
    // Huffman's merge with two queues over the leaves sorted by weight (ties by symbol: deterministic)
    syms.sort_unstable();
    let n = syms.len();
    let mut weight: Vec<u64> = syms.iter().map(|s| s.0).collect();
    let mut parent: Vec<usize> = vec![0; 2 * n - 1];
    let (mut leaf, mut inner) = (0usize, n);
    let mut next = n;
    let pick = |leaf: &mut usize, inner: &mut usize, next: usize, weight: &[u64]| -> usize {
        if *leaf < n && (*inner >= next || weight[*leaf] <= weight[*inner]) {
            *leaf += 1;
            *leaf - 1
        } else {
            *inner += 1;
            *inner - 1
        }
    };
    while next < 2 * n - 1 {
        let a = pick(&mut leaf, &mut inner, next, &weight);
        let b = pick(&mut leaf, &mut inner, next, &weight);
        weight.push(weight[a] + weight[b]);
        parent[a] = next;
        parent[b] = next;
        next += 1;
    }
    // depths: the root (the last node) at 0, each node one below its parent (parents come later)
    let mut depth = vec![0u32; 2 * n - 1];
    for i in (0..2 * n - 2).rev() {
        depth[i] = depth[parent[i]] + 1;
    }
    // how many codes of each length, then no code longer than MAX_LEN (JPEG's adjustment, Annex K.3:
    // the code stays complete)
    let mut bits = vec![0u32; n + 2];
    for &d in &depth[..n] {
        bits[d as usize] += 1;
    }
    let max = MAX_LEN as usize;
    for i in (max + 1..bits.len()).rev() {
        while bits[i] > 0 {
            let mut j = i - 2;
            while bits[j] == 0 {
                j -= 1;
            }
            bits[i] -= 2;
            bits[i - 1] += 1;
            bits[j + 1] += 2;
            bits[j] -= 1;
        }
    }
    // the shortest codes to the most frequent symbols
    let mut out = [0u8; 256];
    let mut len = 1;
    for &(_, s) in syms.iter().rev() {
        while bits[len] == 0 {
            len += 1;
        }
        bits[len] -= 1;
        out[s as usize] = len as u8;
    }
    Some(out)
}

/// Writes `lens` as the [`TABLE_BYTES`]-byte table.
pub fn write_table(lens: &[u8; 256], out: &mut Vec<u8>) {
    out.extend((0..TABLE_BYTES).map(|i| lens[2 * i] | (lens[2 * i + 1] << 4)));
}

/// Reads a table written by [`write_table`]; `None` unless every length is at most [`MAX_LEN`] and the
/// code is complete with at least two symbols.
pub fn read_table(b: &[u8]) -> Option<[u8; 256]> {
    let b = b.get(..TABLE_BYTES)?;
    let mut lens = [0u8; 256];
    let mut kraft = 0u64;
    for (i, &x) in b.iter().enumerate() {
        for (k, l) in [(2 * i, x & 15), (2 * i + 1, x >> 4)] {
            if u32::from(l) > MAX_LEN {
                return None;
            }
            lens[k] = l;
            if l > 0 {
                kraft += 1 << (MAX_LEN - u32::from(l));
            }
        }
    }
    (kraft == 1 << MAX_LEN && lens.iter().filter(|&&l| l > 0).count() >= 2).then_some(lens)
}

/// Canonical codes of `lens`, bit-reversed for least-significant-first writing: `(code, length)`.
fn codes(lens: &[u8; 256]) -> [(u32, u32); 256] {
    let mut count = [0u32; MAX_LEN as usize + 1];
    for &l in lens {
        count[l as usize] += 1;
    }
    count[0] = 0;
    let mut next = [0u32; MAX_LEN as usize + 2];
    for l in 1..=MAX_LEN as usize {
        next[l + 1] = (next[l] + count[l]) << 1;
    }
    let mut out = [(0u32, 0u32); 256];
    for (s, &l) in lens.iter().enumerate() {
        if l > 0 {
            let c = next[l as usize];
            next[l as usize] += 1;
            out[s] = (c.reverse_bits() >> (32 - u32::from(l)), u32::from(l));
        }
    }
    out
}

/// Bits of `syms` coded with `lens` (every symbol must have a code).
pub fn coded_bits(counts: &[u64; 256], lens: &[u8; 256]) -> u64 {
    counts
        .iter()
        .zip(lens)
        .map(|(&c, &l)| c * u64::from(l))
        .sum()
}

/// Splits `n` symbols into the four streams' counts.
pub fn quarters(n: usize) -> [usize; 4] {
    let q = n / 4;
    [q, q, q, n - 3 * q]
}

/// Appends the four streams of `syms` (cut by [`quarters`]) to `out`, after four little-endian u32
/// stream lengths.
pub fn encode4(syms: &[u8], lens: &[u8; 256], out: &mut Vec<u8>) {
    let codes = codes(lens);
    let head = out.len();
    out.extend_from_slice(&[0u8; 16]);
    let mut start = 0;
    for (k, n) in quarters(syms.len()).into_iter().enumerate() {
        let before = out.len();
        encode_stream(&syms[start..start + n], &codes, out);
        start += n;
        let len = (out.len() - before) as u32;
        out[head + 4 * k..head + 4 * k + 4].copy_from_slice(&len.to_le_bytes());
    }
}

fn encode_stream(syms: &[u8], codes: &[(u32, u32); 256], out: &mut Vec<u8>) {
    // written with whole 8-byte stores into room made first (at most MAX_LEN bits a symbol, plus 8 bytes
    // of slack for the last store), then cut to the bytes used
    let start = out.len();
    out.resize(start + syms.len() * MAX_LEN as usize / 8 + 16, 0);
    let buf = &mut out[start..];
    let mut at = 0usize;
    let mut acc: u64 = 0;
    let mut n: u32 = 0;
    let table: [u32; 256] = std::array::from_fn(|s| codes[s].0 | (codes[s].1 << 16));
    let mut groups = syms.chunks_exact(4);
    for g in &mut groups {
        // 4 codes of at most 11 bits on at most 7 bits pending: 51 bits fit
        for &s in g {
            let e = table[s as usize];
            acc |= u64::from(e & 0xffff) << n;
            n += e >> 16;
        }
        buf[at..at + 8].copy_from_slice(&acc.to_le_bytes());
        let whole = n >> 3;
        at += whole as usize;
        acc = if whole == 8 { 0 } else { acc >> (8 * whole) };
        n &= 7;
    }
    for &s in groups.remainder() {
        let e = table[s as usize];
        acc |= u64::from(e & 0xffff) << n;
        n += e >> 16;
    }
    buf[at..at + 8].copy_from_slice(&acc.to_le_bytes());
    at += n.div_ceil(8) as usize;
    out.truncate(start + at);
}

/// Why a stream did not decode.
#[derive(Debug, PartialEq, Eq)]
pub struct Damaged;

/// The multi-symbol look-up table of `lens`: entry `i` holds every whole code in the low [`MAX_LEN`] bits
/// of `i` read greedily, at most four: their symbols (bytes 0..4), how many (bits 32..40), their bits
/// (bits 40..48) and the first code's length (bits 48..56). Every entry holds at least one symbol (the
/// code is complete).
pub fn decode_table(lens: &[u8; 256]) -> Vec<u64> {
    let mut one = vec![0u16; 1 << MAX_LEN];
    for (s, (code, len)) in codes(lens).iter().enumerate() {
        if *len == 0 {
            continue;
        }
        let entry = ((*len as u16) << 8) | s as u16;
        for hi in 0..1u32 << (MAX_LEN - len) {
            one[(code | (hi << len)) as usize] = entry;
        }
    }
    let mask = (1usize << MAX_LEN) - 1;
    (0..1usize << MAX_LEN)
        .map(|i| {
            let (mut syms, mut n, mut bits, mut first) = (0u64, 0u64, 0u32, 0u32);
            while n < 4 {
                let e = one[(i >> bits) & mask];
                let l = u32::from(e >> 8);
                if n > 0 && bits + l > MAX_LEN {
                    break;
                }
                syms |= u64::from(e & 0xff) << (8 * n);
                if n == 0 {
                    first = l;
                }
                n += 1;
                bits += l;
                if bits >= MAX_LEN {
                    break;
                }
            }
            syms | (n << 32) | (u64::from(bits) << 40) | (u64::from(first) << 48)
        })
        .collect()
}

/// Decodes the four streams at the start of `b` (as [`encode4`] wrote them) into `syms`, whose length is
/// the symbol count; returns the bytes of `b` they took. Damaged bytes give garbage symbols or `Damaged`
/// (a stream that ends before or after its last byte), never a panic.
pub fn decode4(b: &[u8], table: &[u64], syms: &mut [u8]) -> Result<usize, Damaged> {
    let head = b.get(..16).ok_or(Damaged)?;
    let mut lens = [0usize; 4];
    for (k, l) in lens.iter_mut().enumerate() {
        *l = u32::from_le_bytes(head[4 * k..4 * k + 4].try_into().expect("4 bytes")) as usize;
    }
    let total = lens.iter().try_fold(16usize, |a, &l| a.checked_add(l));
    let total = total.filter(|&t| t <= b.len()).ok_or(Damaged)?;
    let counts = quarters(syms.len());
    let mut streams: [&[u8]; 4] = [&[]; 4];
    let mut at = 16;
    for k in 0..4 {
        streams[k] = &b[at..at + lens[k]];
        at += lens[k];
    }
    let mut outs = split4(syms, counts);
    let mut pos = [0usize; 4]; // bits consumed, per stream
    let mut done = [0usize; 4]; // symbols decoded, per stream
    let t: &[u64; 1 << MAX_LEN] = table.try_into().map_err(|_| Damaged)?;
    let mask = (1u64 << MAX_LEN) - 1;
    // The interleaved loop: four look-ups (up to 16 symbols, 44 bits) in each stream per round, the four
    // streams in lockstep (four independent chains of look-ups). Rounds are run in runs that need no
    // bounds check: a round takes at most 16 symbols and 44 bits of each stream, so a run of `rounds`
    // rounds stays inside every stream's output part (16 · rounds symbols to go) and every 8-byte load
    // inside its stream (6 · rounds + 9 bytes to go).
    loop {
        let mut rounds = usize::MAX;
        for k in 0..4 {
            let syms_left = (counts[k] - done[k]) / 16;
            let bytes_left = streams[k].len().saturating_sub((pos[k] >> 3) + 9) / 6;
            rounds = rounds.min(syms_left).min(bytes_left);
        }
        if rounds == 0 {
            break;
        }
        let out: [*mut u8; 4] = [
            outs[0].as_mut_ptr(),
            outs[1].as_mut_ptr(),
            outs[2].as_mut_ptr(),
            outs[3].as_mut_ptr(),
        ];
        let src: [*const u8; 4] = [
            streams[0].as_ptr(),
            streams[1].as_ptr(),
            streams[2].as_ptr(),
            streams[3].as_ptr(),
        ];
        for _ in 0..rounds {
            let mut w = [0u64; 4];
            for k in 0..4 {
                // The run's bound above: each round advances pos[k] by at most 44 bits.
                // SAFETY: (pos[k] >> 3) + 8 <= streams[k].len() in every round; an unaligned 8-byte read.
                w[k] = unsafe { src[k].add(pos[k] >> 3).cast::<u64>().read_unaligned() }.to_le()
                    >> (pos[k] & 7);
            }
            let mut used = [0u64; 4];
            for _ in 0..4 {
                let e = [
                    t[(w[0] & mask) as usize],
                    t[(w[1] & mask) as usize],
                    t[(w[2] & mask) as usize],
                    t[(w[3] & mask) as usize],
                ];
                for k in 0..4 {
                    // The run's bound above: a round adds at most 16 to done[k]; the 4 bytes land in
                    // this stream's own part of `syms`.
                    // SAFETY: done[k] + 4 <= counts[k] = outs[k].len() at every look-up; unaligned write.
                    unsafe {
                        out[k]
                            .add(done[k])
                            .cast::<[u8; 4]>()
                            .write_unaligned((e[k] as u32).to_le_bytes())
                    };
                    done[k] += ((e[k] >> 32) & 0xff) as usize;
                    let l = (e[k] >> 40) & 0xff;
                    w[k] >>= l;
                    used[k] += l;
                }
            }
            for k in 0..4 {
                pos[k] += used[k] as usize;
            }
        }
    }
    // the rest of each stream, one look-up's first symbol at a time, loading zeros past the end
    for (k, out) in outs.iter_mut().enumerate() {
        let s = streams[k];
        for o in &mut out[done[k]..] {
            let e = t[(load_tail(s, pos[k]) & mask) as usize];
            *o = e as u8;
            pos[k] += ((e >> 48) & 0xff) as usize; // the first code's length
        }
        // a stream ends in its last byte, exactly
        if pos[k].div_ceil(8) != s.len() {
            return Err(Damaged);
        }
    }
    Ok(total)
}

fn split4(syms: &mut [u8], c: [usize; 4]) -> [&mut [u8]; 4] {
    let (a, rest) = syms.split_at_mut(c[0]);
    let (b, rest) = rest.split_at_mut(c[1]);
    let (cc, d) = rest.split_at_mut(c[2]);
    [a, b, cc, d]
}

/// The 64 bits at bit `pos` of `s` (at least 57 of them valid), with zeros past the end of `s`.
fn load_tail(s: &[u8], pos: usize) -> u64 {
    let p = pos >> 3;
    let mut w = [0u8; 8];
    if p < s.len() {
        let n = (s.len() - p).min(8);
        w[..n].copy_from_slice(&s[p..p + n]);
    }
    u64::from_le_bytes(w) >> (pos & 7)
}

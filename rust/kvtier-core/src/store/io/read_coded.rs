//! Reading a coded object (docs/STORE.md, "Compressed objects"): its stored bytes into an aligned buffer of
//! its own, in pieces summed as read; the stored checksum checked, the bytes opened if sealed, then decoded
//! into the caller's memory chunk by chunk, each chunk against the crc of its decoded bytes. In two passes
//! (`get_in_two`), the first reads and decodes only the chunks that cover the asked prefix.

use std::sync::atomic::Ordering;

use super::seal_io::{Aligned, Opened, SealKeys};
use crate::codec::Header;
use crate::fault;
use crate::hash::PIECE;
use crate::store::index::Entry;
use crate::store::space::files::ClassFile;
use crate::store::{Shared, ALIGN};

// What a read of one object came to (a batch's per-object result; `read` and this module set them).
pub(in crate::store) const OK: u8 = 1;
pub(in crate::store) const CORRUPT: u8 = 2;
pub(in crate::store) const IO_ERROR: u8 = 3;
pub(in crate::store) const NO_KEY: u8 = 4;
pub(in crate::store) const STALE: u8 = 5;

/// A coded object being read: its slot's blocks read so far, their pieces' sums, the chunks decoded.
pub(in crate::store) struct CodedRead {
    buf: Aligned,
    read: usize,
    sums: Vec<(u32, usize)>,
    decoded: usize,
}

impl Shared {
    /// A buffer for the coded object of `e`: its slot's whole blocks (its padding is zeros), so the reads
    /// stay O_DIRECT.
    fn coded_buffer(&self, e: &Entry) -> Result<CodedRead, u8> {
        let whole = (e.len as usize).div_ceil(ALIGN as usize) * ALIGN as usize;
        let buf = self.scratch.take(whole).ok_or(IO_ERROR)?;
        Ok(CodedRead {
            buf,
            read: 0,
            sums: Vec::new(),
            decoded: 0,
        })
    }

    /// Reads the slot's blocks up to `upto` (rounded up to a block, at most the slot's whole blocks) in pieces
    /// on the [`PIECE`] grid, summing each piece's stored bytes as it lands.
    fn coded_read_to(
        &self,
        st: &mut CodedRead,
        e: &Entry,
        c: &ClassFile,
        upto: usize,
    ) -> Result<(), u8> {
        let stored = e.len as usize;
        let b = st.buf.as_mut_slice();
        let upto = (upto.div_ceil(ALIGN as usize) * ALIGN as usize).min(b.len());
        let base = u64::from(e.slot) * u64::from(e.class);
        while st.read < upto {
            let a = st.read;
            let end = ((a / PIECE + 1) * PIECE).min(upto);
            let got =
                fault::check("data_read").and_then(|()| c.read(&mut b[a..end], base + a as u64));
            if let Err(err) = got {
                // a data file that ends inside the object's last block (its zero padding cut, by a copy
                // or a tool): the object's own bytes may still be there, read as they are
                let short =
                    err.kind() == std::io::ErrorKind::UnexpectedEof && end > stored && a < stored;
                if !short || c.read(&mut b[a..stored], base + a as u64).is_err() {
                    return Err(IO_ERROR);
                }
            }
            if a < stored {
                let s = end.min(stored);
                st.sums.push((crate::hash::piece_crc(&b[a..s]), s - a));
            }
            st.read = end;
        }
        Ok(())
    }

    /// Decodes chunks `st.decoded..upto` of the (clear) stored bytes into `[ptr, ptr+len)`.
    fn coded_decode_to(
        &self,
        st: &mut CodedRead,
        h: &Header,
        stored: usize,
        (ptr, len): (usize, u64),
        upto: usize,
    ) -> Result<(), u8> {
        let t = std::time::Instant::now();
        let b = &st.buf.as_slice()[..stored];
        let mut r = Ok(());
        while st.decoded < upto {
            let range = h.raw_range(st.decoded);
            // `range` lies inside [ptr, ptr+len): the header's raw length is `len` (checked by `read_coded_*`),
            // and no other task of the batch touches this object's destination.
            // SAFETY: the caller of `get` guarantees [ptr, ptr+len) is writable and ours for the call.
            let dst = unsafe {
                std::slice::from_raw_parts_mut((ptr + range.start) as *mut u8, range.len())
            };
            debug_assert!(range.end as u64 <= len);
            if h.decode_chunk(b, st.decoded, dst).is_err() {
                r = Err(CORRUPT);
                break;
            }
            st.decoded += 1;
        }
        self.stats
            .decode_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// The first pass of a two-pass read of the coded object of `e` into `[ptr, ptr+len)`: the chunks that
    /// cover its first `prefix` bytes, read (the first piece, which holds the header, then up to those
    /// chunks' end) and decoded. Unchecked as a whole until [`Shared::read_coded`] finishes it.
    pub(in crate::store) fn read_coded_prefix(
        &self,
        e: &Entry,
        (_, ptr, len): (&str, usize, u64),
        c: &ClassFile,
        prefix: usize,
    ) -> Result<CodedRead, u8> {
        let mut st = self.coded_buffer(e)?;
        let stored = e.len as usize;
        let r = (|| {
            self.coded_read_to(&mut st, e, c, PIECE.min(stored))?;
            let h = Header::parse(&st.buf.as_slice()[..stored]).map_err(|_| CORRUPT)?;
            if h.raw_len as u64 != len {
                return Err(CORRUPT);
            }
            let k = h.chunks_covering(prefix);
            self.coded_read_to(&mut st, e, c, h.coded_end(k))?;
            self.coded_decode_to(&mut st, &h, stored, (ptr, len), k)
        })();
        match r {
            Ok(()) => Ok(st),
            Err(x) => {
                self.scratch.give(st.buf);
                Err(x)
            }
        }
    }

    /// Reads the coded object of entry `e` (or the rest of it, after [`Shared::read_coded_prefix`]), checks the
    /// stored bytes, opens them if sealed, and decodes them into `[ptr, ptr+len)`: [`OK`], or why not. A
    /// decode that fails after the stored bytes verified is a corrupt read (a bug, or damage the stored
    /// checksum missed): never served.
    pub(in crate::store) fn read_coded(
        &self,
        e: &Entry,
        (key, ptr, len): (&str, usize, u64),
        c: &ClassFile,
        keys: Option<&SealKeys>,
        first: Option<CodedRead>,
    ) -> u8 {
        let mut st = match first {
            Some(st) => st,
            None => match self.coded_buffer(e) {
                Ok(st) => st,
                Err(r) => return r,
            },
        };
        let stored = e.len as usize;
        let r = (|| {
            let whole = st.buf.as_slice().len();
            self.coded_read_to(&mut st, e, c, whole)?;
            if crate::hash::object_crc_of_pieces(&st.sums, key) != e.crc {
                return Err(CORRUPT);
            }
            if let (Some(k), Some(seal)) = (keys, e.seal.as_ref()) {
                match k.open(key, &mut st.buf.as_mut_slice()[..stored], seal) {
                    Opened::Ok => {}
                    Opened::NoKey => return Err(NO_KEY),
                    Opened::Stale => return Err(STALE),
                    Opened::Failed => return Err(CORRUPT),
                }
            }
            let h = Header::parse(&st.buf.as_slice()[..stored]).map_err(|_| CORRUPT)?;
            if h.raw_len as u64 != len {
                return Err(CORRUPT);
            }
            self.coded_decode_to(&mut st, &h, stored, (ptr, len), h.chunks())?;
            self.stats.decoded_bytes.fetch_add(len, Ordering::Relaxed);
            self.stats
                .decoded_coded_bytes
                .fetch_add(stored as u64, Ordering::Relaxed);
            Ok(())
        })();
        self.scratch.give(st.buf);
        r.map_or_else(|x| x, |()| OK)
    }
}

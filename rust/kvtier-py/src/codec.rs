//! `kvtier._native.codec_encode` / `codec_decode`: the page codec (`kvtier_core::codec`) on bytes, for
//! measuring it on real KV (benches, tests); the page store codes its objects itself.

use kvtier_core::codec::{self, Elem};
use kvtier_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::KvResult;

fn elem(name: &str) -> KvResult<Elem> {
    Ok(Elem::parse(name).ok_or_else(|| {
        Error::arg(
            "codec",
            format!("{name:?} is not a codec; expected \"bits16\" or \"bits8\""),
        )
    })?)
}

/// The coded form of `data` (what the page store writes for an object of these bytes; it stores the
/// object as given instead when that saves no 4 KiB block).
#[pyfunction]
pub fn codec_encode<'py>(
    py: Python<'py>,
    data: &[u8],
    codec: &str,
) -> KvResult<Bound<'py, PyBytes>> {
    let e = elem(codec)?;
    let out = crate::exit::detach_io(py, || {
        let mut v = Vec::with_capacity(codec::max_encoded_len(data.len()));
        codec::encode(data, e, &mut v);
        v
    });
    Ok(PyBytes::new(py, &out))
}

/// The bytes the coded object `data` decodes to (every chunk checked); ValueError if it does not decode.
#[pyfunction]
pub fn codec_decode<'py>(py: Python<'py>, data: &[u8]) -> KvResult<Bound<'py, PyBytes>> {
    let h = codec::Header::parse(data).map_err(|e| Error::arg("data", e.to_string()))?;
    // a header may claim up to 2^32 chunks of CHUNK bytes: refuse what the store never writes (MAX_OBJECT)
    // before allocating it
    if h.raw_len as u64 > kvtier_core::store::MAX_OBJECT {
        return Err(Error::arg(
            "data",
            format!("decodes to {} bytes, more than an object holds", h.raw_len),
        )
        .into());
    }
    let out = crate::exit::detach_io(py, || {
        let mut v = vec![0u8; h.raw_len];
        codec::decode(data, &mut v).map(|()| v)
    });
    let out = out.map_err(|e| Error::arg("data", e.to_string()))?;
    Ok(PyBytes::new(py, &out))
}

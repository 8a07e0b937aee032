//! Tenants and encryption at rest (`kvtier_core::seal`): tenant keys, and the keyring a sealed store or the
//! cluster tier seals with.

use std::path::PathBuf;
use std::sync::Arc;

use kvtier_core::seal::{self, Keyring, Seal, SEAL_LEN};
use kvtier_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::KvResult;
use crate::ranges::PyHostRanges;

/// A deployment's keys (see kvtier.Keyring for the public API).
#[pyclass(name = "Keyring", module = "kvtier._native", frozen)]
pub struct PyKeyring {
    pub(crate) inner: Arc<Keyring>,
}

#[pymethods]
impl PyKeyring {
    #[new]
    fn new(py: Python<'_>, dir: PathBuf) -> KvResult<Self> {
        let inner = Arc::new(py.detach(|| Keyring::open(&dir))?);
        Ok(Self { inner })
    }

    /// Creates a keyring directory with a new master key (refuses an existing one).
    #[staticmethod]
    fn init(py: Python<'_>, dir: PathBuf) -> KvResult<()> {
        Ok(py.detach(|| Keyring::init(&dir))?)
    }

    #[getter]
    fn id(&self) -> String {
        self.inner.id().to_owned()
    }

    #[getter]
    fn dir(&self) -> String {
        self.inner.dir().to_string_lossy().into_owned()
    }

    /// Destroys tenant `tag`'s key; whether there was one.
    fn erase_tenant(&self, py: Python<'_>, tag: String) -> KvResult<bool> {
        Ok(py.detach(|| self.inner.erase_tenant(&tag))?)
    }

    fn tenants(&self) -> Vec<String> {
        self.inner.tenants()
    }

    /// Seals objects of registered host memory: object i, `sizes[i]` bytes at `ptrs[i]` named `names[i]` of
    /// tenant `tenants[i]` (a tag, or None), is copied to `dsts[i]` and sealed there; returns the seals (28 bytes each, concatenated; zeros where
    /// not sealed) and per object whether it was sealed. Every range is checked before any byte moves.
    fn seal_into<'py>(
        &self,
        py: Python<'py>,
        memory: &PyHostRanges,
        names: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<u64>,
        tenants: Vec<Option<String>>,
        dsts: Vec<usize>,
    ) -> KvResult<(Bound<'py, PyBytes>, Vec<bool>)> {
        let objs = objects(&names, &ptrs, &sizes)?;
        let tenants: Vec<Option<&str>> = tenants.iter().map(Option::as_deref).collect();
        let r = py.detach(|| memory.get().seal_into(&self.inner, &objs, &tenants, &dsts))?;
        let mut seals = vec![0u8; r.len() * SEAL_LEN];
        for (s, d) in r.iter().zip(seals.chunks_mut(SEAL_LEN)) {
            if let Some(s) = s {
                d.copy_from_slice(s);
            }
        }
        Ok((PyBytes::new(py, &seals), r.iter().map(Option::is_some).collect()))
    }

    /// Opens sealed objects in place (with their tenants and seals); per object whether it verified.
    fn open_in_place(
        &self,
        py: Python<'_>,
        memory: &PyHostRanges,
        names: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<u64>,
        tenants: Vec<Option<String>>,
        seals: &[u8],
    ) -> KvResult<Vec<bool>> {
        let objs = objects(&names, &ptrs, &sizes)?;
        let tenants: Vec<Option<&str>> = tenants.iter().map(Option::as_deref).collect();
        if seals.len() != objs.len() * SEAL_LEN {
            return Err(Error::arg("seals", format!("{} bytes for {} objects", seals.len(), objs.len())).into());
        }
        let seals: Vec<Seal> = seals
            .chunks(SEAL_LEN)
            .map(|c| c.try_into().expect("SEAL_LEN bytes"))
            .collect();
        Ok(py.detach(|| memory.get().open_in_place(&self.inner, &objs, &tenants, &seals))?)
    }
}

fn objects<'a>(names: &'a [String], ptrs: &[usize], sizes: &[u64]) -> KvResult<Vec<(&'a str, usize, u64)>> {
    if names.len() != ptrs.len() || names.len() != sizes.len() {
        return Err(Error::arg(
            "names",
            format!("{} names, {} addresses and {} sizes", names.len(), ptrs.len(), sizes.len()),
        )
        .into());
    }
    Ok(names
        .iter()
        .zip(ptrs.iter().zip(sizes))
        .map(|(n, (&p, &s))| (n.as_str(), p, s))
        .collect())
}

/// The tenant tag of `salt` (16 hex digits).
#[pyfunction]
pub fn tenant_tag(salt: &str) -> KvResult<String> {
    Ok(seal::tenant_tag(salt)?)
}

/// The tenant-scoped form of each key under `salt`.
#[pyfunction]
pub fn tenant_keys(salt: &str, keys: Vec<String>) -> KvResult<Vec<String>> {
    Ok(seal::tenant_keys(salt, &keys)?)
}

/// The tenant tag a key carries, if any.
#[pyfunction]
pub fn tenant_of(key: &str) -> Option<String> {
    seal::tenant_of(key).map(str::to_owned)
}

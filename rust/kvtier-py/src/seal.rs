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
        let inner = Arc::new(crate::exit::detach_io(py, || Keyring::open(&dir))?);
        Ok(Self { inner })
    }

    /// Creates a keyring directory with a new master key (refuses an existing one).
    #[staticmethod]
    fn init(py: Python<'_>, dir: PathBuf) -> KvResult<()> {
        Ok(crate::exit::detach_io(py, || Keyring::init(&dir))?)
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
        Ok(crate::exit::detach_io(py, || {
            self.inner.erase_tenant(&tag)
        })?)
    }

    /// Lets erased tenant `tag` have a key again; whether it was erased.
    fn allow_tenant(&self, py: Python<'_>, tag: String) -> KvResult<bool> {
        Ok(crate::exit::detach_io(py, || {
            self.inner.allow_tenant(&tag)
        })?)
    }

    /// Whether tenant `tag` is erased in this keyring.
    fn erased(&self, tag: &str) -> KvResult<bool> {
        Ok(self.inner.erased(tag)?)
    }

    /// Whether tenant `tag` has a key file here.
    fn has_key(&self, tag: &str) -> KvResult<bool> {
        Ok(self.inner.has_key(tag)?)
    }

    /// Stored (keyed) tags of the tenants with a key.
    fn tenants(&self) -> Vec<String> {
        self.inner.tenants()
    }

    /// Stored (keyed) tags of the erased tenants.
    fn erased_tenants(&self) -> Vec<String> {
        self.inner.erased_tenants()
    }

    /// The tag tenant `tag` carries in stored names and this keyring's files.
    fn stored_tag(&self, tag: &str) -> KvResult<String> {
        if !seal::valid_tag(tag) {
            return Err(Error::arg("tag", format!("{tag:?} is not a tenant tag")).into());
        }
        Ok(self.inner.stored_tag(tag))
    }

    /// The name each of `keys` is stored under in a sealed store or cluster tier.
    fn stored_names(&self, keys: Vec<String>) -> Vec<String> {
        keys.iter().map(|k| self.inner.stored_name(k)).collect()
    }

    /// The current key id (8 hex digits) of each stored tenant tag (`stored_tag`; None: the default
    /// tenant); None where the tenant has no key (with `create`, a tenant without one gets one) or is
    /// erased (named by its stored tag or by its own tag alike).
    fn key_ids(
        &self,
        py: Python<'_>,
        tags: Vec<Option<String>>,
        create: bool,
    ) -> Vec<Option<String>> {
        let refs: Vec<Option<&str>> = tags.iter().map(Option::as_deref).collect();
        let keys = crate::exit::detach_io(py, || self.inner.keys_for(&refs, create));
        tags.iter()
            .map(|t| keys.get(t).and_then(|k| k.as_ref()).map(|k| k.id_hex()))
            .collect()
    }

    /// Seals objects of registered host memory: object i, `(aad, address, size, stored tenant tag or
    /// None)`, is copied to `dsts[i]` and sealed there, `aad` authenticated with it; returns the seals
    /// (`SEAL_LEN` bytes each, concatenated; zeros where not sealed) and per object whether it was sealed
    /// (never for an erased tenant). Every range is checked before any byte moves.
    fn seal_into<'py>(
        &self,
        py: Python<'py>,
        memory: &PyHostRanges,
        objects: Vec<Object>,
        dsts: Vec<usize>,
    ) -> KvResult<(Bound<'py, PyBytes>, Vec<bool>)> {
        let (objs, tenants) = split(&objects);
        let r = crate::exit::detach_io(py, || {
            memory.get().seal_into(&self.inner, &objs, &tenants, &dsts)
        })?;
        let mut seals = vec![0u8; r.len() * SEAL_LEN];
        for (s, d) in r.iter().zip(seals.chunks_mut(SEAL_LEN)) {
            if let Some(s) = s {
                d.copy_from_slice(s);
            }
        }
        Ok((
            PyBytes::new(py, &seals),
            r.iter().map(Option::is_some).collect(),
        ))
    }

    /// Opens sealed objects in place (as `seal_into`'s objects, with their seals); per object whether it
    /// verified.
    fn open_in_place(
        &self,
        py: Python<'_>,
        memory: &PyHostRanges,
        objects: Vec<Object>,
        seals: &[u8],
    ) -> KvResult<Vec<bool>> {
        if seals.len() != objects.len() * SEAL_LEN {
            return Err(Error::arg(
                "seals",
                format!("{} bytes for {} objects", seals.len(), objects.len()),
            )
            .into());
        }
        let seals: Vec<Seal> = seals
            .chunks(SEAL_LEN)
            .map(|c| c.try_into().expect("SEAL_LEN bytes"))
            .collect();
        let (objs, tenants) = split(&objects);
        Ok(crate::exit::detach_io(py, || {
            memory
                .get()
                .open_in_place(&self.inner, &objs, &tenants, &seals)
        })?)
    }
}

/// `(aad, address, size, stored tenant tag)` of one object.
type Object = (String, usize, u64, Option<String>);

/// Objects as the core takes them (`(name, address, size)`), and their tenants.
type Split<'a> = (Vec<(&'a str, usize, u64)>, Vec<Option<&'a str>>);

fn split(objects: &[Object]) -> Split<'_> {
    objects
        .iter()
        .map(|(n, p, s, t)| ((n.as_str(), *p, *s), t.as_deref()))
        .unzip()
}

/// The tenant tag of `salt` (32 hex digits).
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

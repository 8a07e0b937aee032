//! The batches of `kvtier._native.PageStore`: object batches given as `(key, address, length)`, page batches
//! as token slots of the bound pool, both handed to the core with the GIL released.

use std::sync::Arc;

use kvtier_core::cuda::HostGate;
use kvtier_core::store::{PageBatch, Pages};
use kvtier_core::Error;
use pyo3::prelude::*;

use crate::errors::KvResult;
use crate::store::PyPageStore;

/// A read's two passes: the pool's layers, the layers read first, the gate opened between them.
pub(crate) type Split = (usize, usize, Option<Arc<HostGate>>);

impl PyPageStore {
    /// One object batch; the core checks every range against the registered memory before any IO.
    pub(crate) fn batch(
        &self,
        py: Python<'_>,
        keys: &[String],
        ptrs: &[usize],
        sizes: &[u64],
        reads: bool,
    ) -> KvResult<Vec<bool>> {
        let s = self.store()?;
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return Err(Error::arg(
                "keys",
                format!(
                    "{} keys, {} addresses and {} sizes",
                    keys.len(),
                    ptrs.len(),
                    sizes.len()
                ),
            )
            .into());
        }
        let objs: Vec<(&str, usize, u64)> = keys
            .iter()
            .zip(ptrs)
            .zip(sizes)
            .map(|((k, &p), &n)| (k.as_str(), p, n))
            .collect();
        Ok(crate::exit::detach_io(py, || {
            if reads {
                s.get_objects(&objs)
            } else {
                s.put_objects(&objs)
            }
        })?)
    }

    /// A page batch's work, its arguments converted and owned (it may run on a thread of its own).
    pub(crate) fn page_job(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
        split: Option<Split>,
        staged: bool,
        reads: bool,
    ) -> KvResult<impl FnOnce() -> kvtier_core::Result<Vec<bool>> + Send + 'static> {
        // the bound layout lies inside memory the store keeps registered while it lives (the job holds it)
        let s = self.store()?;
        let idx = crate::transfer::indices(py, "host_indices", host_indices)?;
        Ok(move || {
            let batch = PageBatch {
                keys: &keys,
                host_indices: &idx,
            };
            if let Some((layers, first, gate)) = split {
                s.get_pages_in_two(&batch, layers, first, &mut || {
                    if let Some(g) = &gate {
                        g.open();
                    }
                })
            } else {
                let which = if staged { Pages::Staging } else { Pages::Pool };
                s.page_batch(&batch, reads, which)
            }
        })
    }

    pub(crate) fn pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
        reads: bool,
        split: Option<Split>,
        staged: bool,
    ) -> KvResult<Vec<bool>> {
        let job = self.page_job(py, keys, host_indices, split, staged, reads)?;
        Ok(crate::exit::detach_io(py, job)?)
    }

    /// A staging copy's work (see `copy_pages`), its arguments converted and owned.
    pub(crate) fn copy_job(
        &self,
        py: Python<'_>,
        to_pool: bool,
        host_indices: &Bound<'_, PyAny>,
        staging_indices: &Bound<'_, PyAny>,
    ) -> KvResult<impl FnOnce() -> kvtier_core::Result<()> + Send + 'static> {
        let s = self.store()?;
        let host = crate::transfer::indices(py, "host_indices", host_indices)?;
        let staging = crate::transfer::indices(py, "staging_indices", staging_indices)?;
        Ok(move || s.copy_pages(to_pool, &host, &staging))
    }
}

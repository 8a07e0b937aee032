//! The batches of `kvtier._native.PageStore`: object batches given as `(key, address, length)`, page batches
//! as token slots of the bound pool, both handed to the core with the GIL released.

use std::sync::Arc;

use kvtier_core::cuda::HostGate;
use kvtier_core::store::{PageBatch, Pages};
use kvtier_core::Error;
use pyo3::prelude::*;

use crate::errors::KvResult;
use crate::store::PyPageStore;

impl PyPageStore {
    /// One object batch; the core checks every range against the registered memory before any IO.
    pub(crate) fn batch(
        &self,
        py: Python<'_>,
        keys: &[String],
        ptrs: &[usize],
        sizes: &[u64],
        writes: bool,
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
            if writes {
                s.get_objects(&objs)
            } else {
                s.put_objects(&objs)
            }
        })?)
    }

    pub(crate) fn pages(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        host_indices: &Bound<'_, PyAny>,
        writes: bool,
        split: Option<(usize, usize, Option<Arc<HostGate>>)>,
        staged: bool,
    ) -> KvResult<Vec<bool>> {
        // the bound layout lies inside memory the store keeps registered while it lives (this call holds it)
        let s = self.store()?;
        let idx = crate::transfer::indices(py, "host_indices", host_indices)?;
        Ok(crate::exit::detach_io(py, || {
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
                s.page_batch(&batch, writes, which)
            }
        })?)
    }
}

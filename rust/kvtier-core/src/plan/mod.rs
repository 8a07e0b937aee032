//! Transfer plans: which bytes move between a host KV buffer and per-layer device KV tensors.
//!
//! One side of one pool (K or V, never both: their row sizes differ in asymmetric models) is described by a
//! [`HostGeometry`]. A transfer is a pair of equal-length token-slot index lists, element i of the host list
//! mapping to element i of the device list, applied to a set of layers. [`validate`] proves every index in
//! range (and page structure where the layout needs it) *before* any copy is planned; [`plan`] then turns the
//! pairs into [`Chunk`]s — maximal byte ranges contiguous on both sides — that a copy engine executes:
//! [`copy_cpu`] here, the CUDA copy engine or a GPU kernel elsewhere.
//!
//! Byte offsets, for a token slot `t` and layer `l` with `row = heads * dim * itemsize`:
//! - `layer_first` `(L, S, H, D)`: `l·S·row + t·row`
//! - `page_first` `(S, L, H, D)`: `t·L·row + l·row`
//! - `page_first_direct` `(P, L, ps, H, D)`: `(t / ps)·L·ps·row + l·ps·row + (t % ps)·row`
//! - device layer tensor `(rows, H, D)`: `t·row`

mod chunks;
mod geometry;
mod indices;
#[cfg(test)]
mod tests;

pub use chunks::{addresses, check_chunks, copy_cpu, plan, Chunk, Direction, RawRange};
pub use geometry::{HostGeometry, Layout, Strides};
pub use indices::{validate, IndexRules};

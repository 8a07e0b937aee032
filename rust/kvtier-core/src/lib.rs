//! kvtier's pure-Rust core: the memory and IO half of a host/disk tier for LLM KV caches.
//!
//! - [`buffer`]: aligned, pre-faulted anonymous host memory ([`buffer::HostRegion`]), optionally on huge
//!   pages and registered (pinned) with the CUDA driver.
//! - [`cuda`]: the CUDA driver, loaded at run time; absent drivers are an error value, never a link failure.
//! - [`progress`]: bytes done of a long step (pre-faulting, registration), read by another thread.
//! - [`alloc`]: whole-page token-slot allocation with HiCache's semantics and checked frees.
//! - [`plan`]: validation of transfer indices and the byte-range plans that copy engines execute.
//! - [`engine`]: the transfer engine: plans executed with `memcpy` or submitted to CUDA streams (copy
//!   engine or compiled kernels) with lanes, per-layer events, flow control and background submission.
//! - [`store`]: the durable, checksummed, capacity-bounded page store (O_DIRECT), with its [`journal`]
//!   (design: docs/STORE.md).
//! - [`ranges`]: registered host memory, range checks and checksums over it (remote tiers).
//! - [`codec`]: lossless compression of KV page objects (exponent planes Huffman-coded), for the slow tiers.
//! - [`hash`]: SGLang-compatible chained SHA-256 page keys.
//! - [`seal`]: tenant-scoped keys and AES-256-GCM sealing of stored objects (encryption at rest).
//! - [`fault`]: IO fault injection points for tests.
//!
//! Threading model: every type here is `Send + Sync` with interior locks; long operations (pre-faulting,
//! registration, copies) use scoped threads and never call back into a caller. No Python, no torch: the
//! binding crate `kvtier-py` converts and calls, the Python package owns policy.
#![deny(missing_docs)]

pub mod alloc;
pub mod buffer;
pub mod codec;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod fault;
pub mod hash;
pub mod plan;
pub mod progress;
pub mod ranges;
pub mod roofline;
pub mod seal;
pub mod store;

pub use store::journal;

pub use error::{Error, Result};

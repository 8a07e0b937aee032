//! The CUDA driver, loaded at run time.
//!
//! kvtier builds and tests on machines without CUDA, so it never links against it: `libcuda.so.1` (the
//! driver, whose ABI is stable across toolkit versions) is opened with `dlopen` on first use. Using the
//! driver rather than a `libcudart` avoids loading a second runtime beside the one torch ships; pages are
//! registered with `CU_MEMHOSTREGISTER_PORTABLE`, so every context in the process (torch's primary context
//! included) sees them as pinned.
//!
//! Every entry point is resolved once; a missing library or symbol is
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable).

mod context;
mod copy;
mod driver;
mod gate;
mod launch;
mod registration;
mod streams;

pub use context::{make_current, Current};
pub use copy::{batch_flags, batch_limit, batch_supported, set_batch_limit, Submitted};
pub use driver::available;
pub use gate::HostGate;
pub use launch::{Kernel, Param};
pub use registration::{is_host_registered, register_ranges, unregister_all, Registration};
pub use streams::Lanes;

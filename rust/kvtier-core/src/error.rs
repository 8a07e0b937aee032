//! The core's one error type. Every variant names what was attempted and on what, so the binding can turn
//! it into a precise Python exception (`ValueError` naming the argument, `OSError` keeping its errno, ...).

use std::io;

/// Errors of the kvtier core.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller-supplied argument is out of its domain. `name` is the argument as the user spelled it.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// The argument's name, e.g. `host_indices`.
        name: String,
        /// What is wrong with it, with the offending value.
        reason: String,
    },
    /// An operating-system call failed; the `io::Error` keeps the errno.
    #[error("{what}: {source}")]
    Os {
        /// What was attempted, e.g. `mmap of 4096 bytes`.
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Huge pages were demanded but the system cannot provide them.
    #[error("huge pages unavailable: {0}")]
    HugePagesUnavailable(String),
    /// The CUDA driver library could not be loaded or initialised.
    #[error("CUDA driver unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver call returned an error code.
    #[error("CUDA driver call {call} failed with CUresult {code}{detail}")]
    Cuda {
        /// The driver entry point.
        call: &'static str,
        /// The `CUresult`.
        code: i32,
        /// Extra context (address range, chunk index), may be empty.
        detail: String,
    },
    /// A handle was used after `close()`.
    #[error("{0} is closed")]
    Closed(&'static str),
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn arg(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            reason: reason.into(),
        }
    }

    /// Wraps the current `errno` with a description of the attempted call.
    pub fn last_os(what: impl Into<String>) -> Self {
        Error::Os {
            what: what.into(),
            source: io::Error::last_os_error(),
        }
    }
}

/// `Result` with the core's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

//! Moving object bytes between the caller's memory and the data files: put (`write`, its blocks in
//! `allocate`, its coding in `encode`), get and verify (`read`, coded objects in `read_coded`), sealed and
//! coded objects' aligned buffers (`seal_io`), page-level batches over a bound host pool (`pages`, its
//! staging pages in `staging`) and the host memory registered for IO (`memory`).

pub(super) mod allocate;
pub(super) mod encode;
pub(super) mod memory;
pub(super) mod pages;
pub(super) mod read;
pub(super) mod read_coded;
pub(super) mod seal_io;
pub(super) mod staging;
pub(super) mod write;
